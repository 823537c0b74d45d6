"""Parallel strategies built on the mesh and the collectives: data, ZeRO, tensor, pipeline, checkpointing."""
