"""Pipeline schedules as plain data, and a simulator: which stage runs which micro-batch when, on paper.

    from shardwise.schedules import Costs, get_schedule, simulate
    s = get_schedule("zb-h1", p=4, m=8)       # "gpipe" | "1f1b" | "interleaved" (chunks >= 2) | "zb-h1" | "zb-h2"
    r = simulate(s, Costs(F=1, B=1, W=1, comm=0))
    r.makespan, r.bubble_ratio, r.peak_in_flight

A ``Schedule`` is one list of ``Action`` per rank (forward, backward, weight-gradient of a micro-batch on a
stage); ``parse_schedule`` reads the text form ``shardwise schedule`` prints, ``lower_communication`` adds the
explicit sends and receives, ``simulate`` runs it on per-action ``Costs`` (a deadlock raises
``ScheduleDeadlock``). Pure: no processes, no communication. ``sw.pipeline`` runs the same schedules.
"""

from .parallel.pipeline import (SCHEDULES, Action, Costs, Schedule, ScheduleDeadlock, SimResult, get_schedule,
                                lower_communication, parse_action, parse_actions, parse_schedule, simulate)

__all__ = ["get_schedule", "SCHEDULES", "Schedule", "Action", "parse_action", "parse_actions", "parse_schedule",
           "lower_communication", "simulate", "Costs", "SimResult", "ScheduleDeadlock"]
