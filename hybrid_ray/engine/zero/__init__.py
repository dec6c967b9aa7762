"""ZeRO by composition: flat buffers -> gradient reducer -> sharded optimizer, and stage 3.

    flat.py       parameters as views into flat buffers, split into buckets and rank shards
    reducer.py    gradients -> this rank's fp32 master-gradient shard (stages 0-2), overlapped
    optimizer.py  the sharded optimizer step: norm, overflow, clipping, all-gather back
    update.py     the update itself: gradients unscaled and clipped (in the kernel where it can)
    stage3.py     stage 3: parameters partitioned too, gathered just in time
    offload.py    optimizer state, masters and master gradients in host memory
    relayout.py   fp32 state between the sharded layout and one tensor per parameter
"""
