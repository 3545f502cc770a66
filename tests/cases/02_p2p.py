"""Chapter 02: the mistakes its check must name."""

from mutation import Mutation

MUTATIONS = [
    # Every rank waits to hear before it speaks: on gloo a send also waits for its recv.
    Mutation("rank 0 receives before it sends",
             "        dist.send(token, dst=right)\n        dist.recv(token, src=left)\n",
             "        dist.recv(token, src=left)\n        dist.send(token, dst=right)\n",
             "likely a deadlock", 2),
    Mutation("token goes the wrong way round",
             "left, right = (rank - 1) % world_size, (rank + 1) % world_size\n    token",
             "left, right = (rank + 1) % world_size, (rank - 1) % world_size\n    token",
             "the token went the wrong way round", 4),
    Mutation("own digit not appended", "        token = token * 10 + rank + 1\n", "",
             "this rank's digit is missing", 4),
    Mutation("halos without tags (2 ranks: one neighbour on both sides)",
             "    return [\n        dist.irecv(left_halo, src=left, tag=GOING_RIGHT),\n"
             "        dist.irecv(right_halo, src=right, tag=GOING_LEFT),\n"
             "        dist.isend(local[:width].contiguous(), dst=left, tag=GOING_LEFT),\n"
             "        dist.isend(local[-width:].contiguous(), dst=right, tag=GOING_RIGHT),\n",
             "    return [\n        dist.irecv(left_halo, src=left),\n"
             "        dist.irecv(right_halo, src=right),\n"
             "        dist.isend(local[:width].contiguous(), dst=left),\n"
             "        dist.isend(local[-width:].contiguous(), dst=right),\n",
             "the two directions need different tags", 2),
    Mutation("wrong edge sent",
             "dist.isend(local[:width].contiguous(), dst=left, tag=GOING_LEFT),\n"
             "        dist.isend(local[-width:].contiguous(), dst=right, tag=GOING_RIGHT),",
             "dist.isend(local[-width:].contiguous(), dst=left, tag=GOING_LEFT),\n"
             "        dist.isend(local[:width].contiguous(), dst=right, tag=GOING_RIGHT),",
             "you sent the wrong edge", 4),
    Mutation("edge slice off by one", "dist.isend(local[:width].contiguous()",
             "dist.isend(local[1:width + 1].contiguous()", "shifted by one element (off by one)", 2),
]
NPROCS = (2, 4)
