"""Pipeline parallelism: schedules as plain data (``actions``, ``schedules``), a simulator (``simulate``),
lowering to explicit send/receive actions (``communication``) and the ``shardwise schedule`` command."""

from .actions import Action, Schedule, parse_action, parse_actions, parse_schedule
from .communication import lower_communication
from .schedules import SCHEDULES, get_schedule
from .simulate import Costs, ScheduleDeadlock, SimResult, simulate

__all__ = ["Action", "Schedule", "parse_action", "parse_actions", "parse_schedule", "lower_communication",
           "SCHEDULES", "get_schedule", "Costs", "ScheduleDeadlock", "SimResult", "simulate"]
