"""Chapter 03: the mistakes its check must name."""

from mutation import Mutation, Variant

STEP = ("        ops = [dist.P2POp(dist.isend, tensor_list[send_slot], right),\n"
        "               dist.P2POp(dist.irecv, tensor_list[recv_slot], left)]\n"
        "        for request in dist.batch_isend_irecv(ops):\n            request.wait()\n")
LOOP = ("    for step in range(world_size - 1):\n"
        "        send_slot, recv_slot = (rank - step) % world_size, (rank - step - 1) % world_size\n")
SLOTS = "recv_slot = (rank - step) % world_size, (rank - step - 1) % world_size"

MUTATIONS = [
    # REVIEW 6: a dtype not kept (float64 and int64 values float32 cannot hold), and the root ignored at 2 ranks
    Mutation("broadcast through float32",
             "                dist.send(tensor, dst=peer)\n    else:\n        dist.recv(tensor, src=src)\n",
             "                dist.send(tensor.float(), dst=peer)\n    else:\n"
             "        buffer = tensor.float()\n        dist.recv(buffer, src=src)\n        tensor.copy_(buffer)\n",
             "rounded to float32", 2),
    Mutation("broadcast always from rank 0 (2 ranks)",
             "    if rank == src:\n        for peer in range(world_size):\n            if peer != src:\n"
             "                dist.send(tensor, dst=peer)\n    else:\n        dist.recv(tensor, src=src)\n",
             "    if rank == 0:\n        for peer in range(1, world_size):\n"
             "                dist.send(tensor, dst=peer)\n    else:\n        dist.recv(tensor, src=0)\n",
             "the root is rank 1: send from (and receive from) `src`, not 0", 2),
    Mutation("broadcast rebinds the name instead of receiving in place",
             "        dist.recv(tensor, src=src)\n",
             "        tensor = torch.empty_like(tensor)\n        dist.recv(tensor, src=src)\n",
             "broadcast works in place", 2),
    # REVIEW D: a root hard-coded to 0 got a generic hint
    Mutation("broadcast hard-coded to root 0",
             "    if rank == src:\n        for peer in range(world_size):\n            if peer != src:\n"
             "                dist.send(tensor, dst=peer)\n    else:\n        dist.recv(tensor, src=src)\n",
             "    if rank == 0:\n        for peer in range(world_size):\n            if peer != 0:\n"
             "                dist.send(tensor, dst=peer)\n    else:\n        dist.recv(tensor, src=0)\n",
             "send from (and receive from) `src`, not 0", 3),
    # REVIEW F: gloo's "Pair is not connected" came raw, with a traceback, and the hint never fired
    Mutation("broadcast receives from rank 0 whatever the root",
             "        dist.recv(tensor, src=src)\n", "        dist.recv(tensor, src=0)\n",
             "the root is `src`, whichever rank the caller names", 3),
    # REVIEW F: the receiving ranks hold their own tensors; rank 0 was told "send from `src`, not 0"
    Mutation("broadcast receives into a new tensor and rebinds the name",
             "        dist.recv(tensor, src=src)\n",
             "        received = torch.empty_like(tensor)\n        dist.recv(received, src=src)\n"
             "        tensor = received\n",
             "holds rank 0's tensor, expected rank 1's tensor: the receiving ranks still hold their own", 3),
    Mutation("gather forgets the destination's own slot", "        gather_list[dst].copy_(tensor)\n", "",
             "the destination's own slot", 2),
    Mutation("gather rebinds its own slot", "        gather_list[dst].copy_(tensor)\n",
             "        gather_list[dst] = tensor\n", "fill the tensors the caller gave you in place", 2),
    # REVIEW D: passed at 2 ranks (only one other rank can send)
    Mutation("gather receives without src", "                dist.recv(gather_list[peer], src=peer)\n",
             "                dist.recv(gather_list[peer])\n", "called recv without src", 2),
    Mutation("gather receives into its own index", "                dist.recv(gather_list[peer], src=peer)\n",
             "                dist.recv(gather_list[rank], src=peer)\n", "(the list is in rank order)", 3),
    Mutation("all_gather forgets its own slot", "    tensor_list[rank].copy_(tensor)\n", "",
             "your own slot", 2),
    Mutation("all_gather receives into the wrong slot (off by one)",
             SLOTS, "recv_slot = (rank - step) % world_size, (rank - step + 1) % world_size",
             "off by one?", 4),
    Mutation("all_gather sends the slot it is receiving",
             SLOTS, "recv_slot = (rank - step - 1) % world_size, (rank - step - 1) % world_size",
             "while a receive into it was still in flight", 3),
    # REVIEW D: posting every step, then waiting once, was flaky and called "off by one"
    Mutation("all_gather posts every step, then waits once", LOOP + STEP,
             "    requests = []\n" + LOOP +
             "        requests += dist.batch_isend_irecv([dist.P2POp(dist.isend, tensor_list[send_slot], right),\n"
             "                                            dist.P2POp(dist.irecv, tensor_list[recv_slot], left)])\n"
             "    for request in requests:\n        request.wait()\n",
             "while a receive into it was still in flight", 3),
    # Either direction is a ring (REVIEW 4, A): this one sends to the left but numbers its slots as a
    # ring going right, so the values are wrong, and the known mistake is named from its outcome.
    Mutation("all_gather messages go left while the slots go right",
             "    left, right = (rank - 1) % world_size, (rank + 1) % world_size\n",
             "    right, left = (rank - 1) % world_size, (rank + 1) % world_size\n",
             "the slot numbers the other way", 3),
    # REVIEW 4, 03 item 7: unwaited requests in gather and broadcast were called deadlocks
    Mutation("gather posts its irecvs and returns",
             "        for peer in range(world_size):\n            if peer != dst:\n"
             "                dist.recv(gather_list[peer], src=peer)\n",
             "        requests = [dist.irecv(gather_list[peer], src=peer) for peer in range(world_size) if peer != dst]\n",
             "never waited for (irecv", 4),
    Mutation("broadcast's root isends and returns", "                dist.send(tensor, dst=peer)\n",
             "                dist.isend(tensor, dst=peer)\n", "never waited for (isend", 4),
    Mutation("all_gather forwards its own slot at every step",
             "        ops = [dist.P2POp(dist.isend, tensor_list[send_slot], right),\n",
             "        ops = [dist.P2POp(dist.isend, tensor_list[rank], right),\n",
             "sent its own slot at every step", 4),
    Mutation("gather rebinds its own slot to a copy", "        gather_list[dst].copy_(tensor)\n",
             "        gather_list[dst] = tensor.clone()\n", "was replaced by another tensor", 4),
    # Blocking calls in a ring: every rank sends first, and on gloo a send waits for its recv.
    Mutation("all_gather with blocking send then recv on every rank", STEP,
             "        dist.send(tensor_list[send_slot], dst=right)\n"
             "        dist.recv(tensor_list[recv_slot], src=left)\n",
             "likely a deadlock", 2),
]

CORRECT = [
    # A binomial tree (log2 N rounds, receivers pass the tensor on) is a right broadcast: the hints
    # that blame messages between non-roots must fire only once the call failed.
    Variant("broadcast as a binomial tree",
            "    if rank == src:\n        for peer in range(world_size):\n            if peer != src:\n"
            "                dist.send(tensor, dst=peer)\n    else:\n        dist.recv(tensor, src=src)\n",
            "    rel, mask = (rank - src) % world_size, 1\n"
            "    while mask < world_size:\n"
            "        if rel < mask and rel + mask < world_size:\n"
            "            dist.send(tensor, dst=(rel + mask + src) % world_size)\n"
            "        elif mask <= rel < 2 * mask:\n"
            "            dist.recv(tensor, src=(rel - mask + src) % world_size)\n"
            "        mask *= 2\n", 3),
    # REVIEW 4, A: the ring turned the other way (send left, receive right) was rejected at 4 ranks
    Variant("all_gather ring turned the other way", LOOP + STEP,
            LOOP.replace("(rank - step) % world_size, (rank - step - 1) % world_size",
                         "(rank + step) % world_size, (rank + step + 1) % world_size")
            + STEP.replace("send_slot], right", "send_slot], left").replace("recv_slot], left", "recv_slot], right"), 4),
    Variant("gather posts every irecv, then waits on all",
            "        for peer in range(world_size):\n            if peer != dst:\n"
            "                dist.recv(gather_list[peer], src=peer)\n",
            "        requests = [dist.irecv(gather_list[peer], src=peer) for peer in range(world_size) if peer != dst]\n"
            "        for request in requests:\n            request.wait()\n", 4),
    Variant("broadcast's root isends to all, then waits on each",
            "        for peer in range(world_size):\n            if peer != src:\n"
            "                dist.send(tensor, dst=peer)\n",
            "        requests = [dist.isend(tensor, dst=peer) for peer in range(world_size) if peer != src]\n"
            "        for request in requests:\n            request.wait()\n", 3),
    Variant("all_gather posts the receive first, then waits on each", STEP,
            "        requests = dist.batch_isend_irecv([dist.P2POp(dist.irecv, tensor_list[recv_slot], left),\n"
            "                                           dist.P2POp(dist.isend, tensor_list[send_slot], right)])\n"
            "        for request in reversed(requests):\n            request.wait()\n", 3),
    Variant("gather in reverse rank order, with a name imported from torch.distributed",
            "        for peer in range(world_size):\n            if peer != dst:\n"
            "                dist.recv(gather_list[peer], src=peer)\n",
            "        from torch.distributed import recv\n"
            "        for peer in reversed(range(world_size)):\n            if peer != dst:\n"
            "                recv(gather_list[peer], src=peer)\n", 3),
    # REVIEW 5, A (the newcomer's): the chapter says "send/recv (or isend/irecv) only"; unbatched
    # requests, both waited each step, are a right ring (it was refused as "outside batch_isend_irecv")
    Variant("all_gather with isend/irecv one by one, both waited each step", STEP,
            "        requests = [dist.isend(tensor_list[send_slot], dst=right), "
            "dist.irecv(tensor_list[recv_slot], src=left)]\n"
            "        for request in requests:\n            request.wait()\n", 2),
]

# Right on gloo, wrong on a GPU machine: seen when the check runs it again on a stand-in GPU
MUTATIONS += [
    # only the root sends (a CPU copy): the other ranks must not be left waiting for a verdict
    Mutation("the root sends a CPU copy", "                dist.send(tensor, dst=peer)\n",
             "                dist.send(tensor.cpu(), dst=peer)\n", "is made by `dist.send(tensor.cpu(), dst=peer)`", 3),
]
