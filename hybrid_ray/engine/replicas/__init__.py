"""Buddy replicas of each rank's ZeRO shard in another rank's host memory, and recovery from
them without a disk read (the `fault_tolerance` config section)."""
from .keeper import KEEPER, Keeper, Plan, plan
from .ring import ReplicaError, Replicator
from .snapshot import Snapshot

__all__ = ["KEEPER", "Keeper", "Plan", "plan", "ReplicaError", "Replicator", "Snapshot"]
