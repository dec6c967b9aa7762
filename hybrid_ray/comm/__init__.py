"""`deepspeed.comm` (`import hybrid_ray.comm as dist`): torch.distributed's collectives, also
answering for a world of one without a process group. The logic: hybrid_ray/compat/dist.py."""
from ..compat.dist import (ReduceOp, all_gather, all_gather_into_tensor, all_gather_object,
                           all_reduce, barrier, broadcast, broadcast_object_list,
                           destroy_process_group, get_backend, get_global_rank, get_local_rank,
                           get_rank, get_world_group, get_world_size, init_distributed,
                           is_available, is_initialized, new_group, reduce, reduce_scatter_tensor)

__all__ = ["ReduceOp", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_reduce",
           "barrier", "broadcast", "broadcast_object_list", "destroy_process_group", "get_backend",
           "get_global_rank", "get_local_rank", "get_rank", "get_world_group", "get_world_size",
           "init_distributed", "is_available", "is_initialized", "new_group", "reduce",
           "reduce_scatter_tensor"]
