"""Pieces every strategy shares: gradient buckets, mixed precision, activation checkpointing, memory reports."""
