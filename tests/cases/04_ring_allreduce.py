"""Chapter 04: the mistakes its check must name."""

from mutation import Mutation, Variant

SCATTER = ("        arrived = landing[:chunks[receive].numel()]\n"
           "        send_right_receive_left(chunks[send], arrived)\n"
           "        chunks[receive] += arrived\n")
COPY_BACK = "        g.copy_(flat[offset:offset + g.numel()].view_as(g))\n"
EXCHANGE = "    ops = [dist.P2POp(dist.irecv, incoming, left), dist.P2POp(dist.isend, outgoing, right)]\n"
WAIT = "    for request in dist.batch_isend_irecv(ops):\n        request.wait()\n"

MUTATIONS = [
    Mutation("off-by-one chunk index",
             "send, receive = (rank - step) % world_size, (rank - step - 1) % world_size",
             "send, receive = (rank - step) % world_size, (rank - step + 1) % world_size",
             "an off-by-one chunk index", 4),
    Mutation("off-by-one chunk index in the all-gather",
             "send, receive = (rank + 1 - step) % world_size, (rank - step) % world_size",
             "send, receive = (rank - step) % world_size, (rank - step) % world_size",
             "off-by-one chunk index in the all-gather?", 3),
    Mutation("remainder chunk dropped",
             "sizes = [base + (1 if i < extra else 0) for i in range(world_size)]\n",
             "sizes = [base for i in range(world_size)]\n",
             "the first numel % world_size chunks get one extra element", 4),
    # REVIEW D: flat.chunk(N) returns fewer than N chunks on small tensors; it crashed with IndexError
    Mutation("flat.chunk(world_size)",
             "    return [flat[start:start + size] for start, size in zip(starts, sizes)]\n",
             "    return list(flat.chunk(world_size))\n",
             "may return fewer than n", 2),
    Mutation("chunks are copies",
             "    return [flat[start:start + size] for start, size in zip(starts, sizes)]\n",
             "    return [flat[start:start + size].clone() for start, size in zip(starts, sizes)]\n",
             "the chunks are copies, not views", 3),
    Mutation("no division by world_size", "    flat /= world_size\n", "",
             "did you divide by world_size?", 2),
    Mutation("division by world_size twice", "    flat /= world_size\n", "    flat /= world_size\n" * 2,
             "did you divide by world_size twice?", 3),
    # REVIEW D: torch.cat's copy never written back was blamed on averaging
    Mutation("torch.cat copy never written back", COPY_BACK, "        g = flat[offset:offset + g.numel()].view_as(g)\n",
             "torch.cat makes a copy", 2),
    Mutation("offset never advanced", "        offset += g.numel()\n", "",
             "does the offset advance", 2),
    # REVIEW D: receiving into the chunk itself, then adding, was called "off by one"
    Mutation("receive into the chunk, then +=", SCATTER,
             "        send_right_receive_left(chunks[send], chunks[receive])\n"
             "        chunks[receive] += chunks[receive]\n",
             "did you receive into the chunk itself and then add?", 3),
    Mutation("all-gather adds instead of replacing",
             "        send_right_receive_left(chunks[send], chunks[receive])\n",
             "        arrived = landing[:chunks[receive].numel()]\n"
             "        send_right_receive_left(chunks[send], arrived)\n"
             "        chunks[receive] += arrived\n",
             "It must replace the chunk, not add to it", 3),
    Mutation("the ring averages", "    return tensor\n\n\n# --- Your part 2",
             "    tensor /= world_size\n    return tensor\n\n\n# --- Your part 2",
             "ring_all_reduce sums; averaging is the caller's job", 4),
    Mutation("blocking recv before send deadlocks",
             "    ops = [dist.P2POp(dist.irecv, incoming, left), dist.P2POp(dist.isend, outgoing, right)]\n"
             "    for request in dist.batch_isend_irecv(ops):\n        request.wait()\n",
             "    dist.recv(incoming, src=left)\n    dist.send(outgoing, dst=right)\n",
             "likely a deadlock", 2),
    Mutation("all-gather phase missing",
             "        send_right_receive_left(chunks[send], chunks[receive])\n",
             "        pass\n",
             "is the all-gather phase missing?", 4),
    Mutation("a collective inside the ring",
             "    chunks = ring_chunks(tensor.view(-1), world_size)\n",
             "    dist.all_reduce(tensor)\n    return tensor\n",
             "build it from isend/irecv only", 2),
    Mutation("offset never advanced in the copy-back",
             "        offset += g.numel()\n    # END SOLUTION", "    # END SOLUTION",
             "does the offset advance by each grad's numel()?", 3),
    # Found by a learner (issue 19): passed at 2 ranks, "an off-by-one chunk index?" at 3; the dry run
    # plays a 3-rank ring, so 2 ranks show it too
    Mutation("ring direction reversed", EXCHANGE,
             "    ops = [dist.P2POp(dist.irecv, incoming, right), dist.P2POp(dist.isend, outgoing, left)]\n",
             "the ring goes the other way", 2),
    # Found by a learner: a timeout inside the check's own all_reduce, or "Connection reset by peer"
    Mutation("only the first request waited", WAIT, "    dist.batch_isend_irecv(ops)[0].wait()\n",
             "wait on every request (the irecv too)", 2),
    # Found by a learner: one rank crashed in add_ (raw size error), the others timed out
    Mutation("receive buffer the size of chunk 0", SCATTER,
             "        send_right_receive_left(chunks[send], landing)\n"
             "        chunks[receive] += landing\n",
             "receive into a buffer of the incoming chunk's size", 3),
    # passed on gloo; NCCL wants the pair posted as one group
    Mutation("isend and irecv posted one by one", EXCHANGE + WAIT,
             "    for request in [dist.isend(outgoing, right), dist.irecv(incoming, left)]:\n        request.wait()\n",
             "pass both as dist.P2POp to dist.batch_isend_irecv", 2),
    Mutation("outgoing and incoming swapped", EXCHANGE,
             "    ops = [dist.P2POp(dist.isend, incoming, right), dist.P2POp(dist.irecv, outgoing, left)]\n",
             "are `outgoing` and `incoming` swapped?", 2),
    # issue 19: was "an off-by-one chunk index?"
    Mutation("scatter-reduce rebinds the chunk (not in place)", "        chunks[receive] += arrived\n",
             "        chunks[receive] = chunks[receive] + arrived\n",
             "add in place (chunks[i] += arrived)", 2),
    Mutation("one step too many in the scatter-reduce (the sum stays right)",
             "    landing = torch.empty_like(chunks[0])  # room for the largest chunk, allocated once\n"
             "    for step in range(world_size - 1):",
             "    landing = torch.empty_like(chunks[0])  # room for the largest chunk, allocated once\n"
             "    for step in range(world_size):",
             "run each phase for exactly N - 1 steps", 3),
    # REVIEW 4, 04 item 5: passed; the contract says one ring on one flat buffer (measured: messages per step)
    Mutation("one ring_all_reduce per parameter",
             "    flat = torch.cat([g.reshape(-1) for g in grads])\n    ring_all_reduce(flat)\n    flat /= world_size\n"
             "    offset = 0\n    for g in grads:\n        g.copy_(flat[offset:offset + g.numel()].view_as(g))\n"
             "        offset += g.numel()\n",
             "    for g in grads:  # one ring per parameter\n        ring_all_reduce(g)\n        g /= world_size\n",
             "4 rings per step", 2),
    # REVIEW 4, 04 item 8: the landing buffer the size of the last (smallest) chunk
    Mutation("landing buffer the size of the last chunk",
             "    landing = torch.empty_like(chunks[0])  # room for the largest chunk, allocated once\n",
             "    landing = torch.empty_like(chunks[-1])\n",
             "receive into a buffer of the incoming chunk's size", 4),
    Mutation("the ring averages floating tensors", "    return tensor\n\n\n# --- Your part 2",
             "    tensor.div_(world_size) if tensor.is_floating_point() else None\n"
             "    return tensor\n\n\n# --- Your part 2",
             "ring_all_reduce sums; averaging is the caller's job", 4),
    Mutation("only the receive waited, the send posted first", EXCHANGE + WAIT,
             "    requests = dist.batch_isend_irecv([dist.P2POp(dist.isend, outgoing, right),\n"
             "                                       dist.P2POp(dist.irecv, incoming, left)])\n"
             "    requests[1].wait()\n",
             "returned without waiting on its isend", 2),
]

# Right code written otherwise: the check must pass it (found by trying it as a learner might).
CORRECT = [
    Variant("chunks by torch.tensor_split",
            "    base, extra = divmod(flat.numel(), world_size)\n"
            "    sizes = [base + (1 if i < extra else 0) for i in range(world_size)]\n"
            "    starts = [sum(sizes[:i]) for i in range(world_size)]\n"
            "    return [flat[start:start + size] for start, size in zip(starts, sizes)]\n",
            "    return list(torch.tensor_split(flat, world_size))\n", 3),
    # REVIEW 4, 04 item 8: rank r owns chunk r at the end, a landing buffer per step
    Variant("another schedule: rank r ends owning chunk r, a fresh landing buffer per step",
            "    landing = torch.empty_like(chunks[0])  # room for the largest chunk, allocated once\n"
            "    for step in range(world_size - 1):\n"
            "        send, receive = (rank - step) % world_size, (rank - step - 1) % world_size\n"
            "        arrived = landing[:chunks[receive].numel()]\n"
            "        send_right_receive_left(chunks[send], arrived)\n"
            "        chunks[receive] += arrived\n",
            "    for step in range(world_size - 1):\n"
            "        send, receive = (rank - step - 1) % world_size, (rank - step - 2) % world_size\n"
            "        arrived = torch.empty_like(chunks[receive])\n"
            "        send_right_receive_left(chunks[send], arrived)\n"
            "        chunks[receive].add_(arrived)\n"
            "    for step in range(world_size - 1):  # its all-gather starts from the chunk it owns, chunk r\n"
            "        send, receive = (rank - step) % world_size, (rank - step - 1) % world_size\n"
            "        send_right_receive_left(chunks[send], chunks[receive])\n"
            "    return tensor  # (the solution's own all-gather below is not reached)\n", 4),
    # REVIEW 4, 04 item 8: torch's own flatten helpers, the division before the ring
    Variant("_flatten_dense_tensors, divided before the ring",
            "    flat = torch.cat([g.reshape(-1) for g in grads])\n    ring_all_reduce(flat)\n    flat /= world_size\n"
            "    offset = 0\n    for g in grads:\n        g.copy_(flat[offset:offset + g.numel()].view_as(g))\n"
            "        offset += g.numel()\n",
            "    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors\n"
            "    flat = _flatten_dense_tensors(grads).div_(world_size)\n    ring_all_reduce(flat)\n"
            "    for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):\n        g.copy_(synced)\n", 3),
    Variant("parameters_to_vector for the flat copy",
            "    flat = torch.cat([g.reshape(-1) for g in grads])\n",
            "    flat = torch.nn.utils.parameters_to_vector(grads)\n", 3),
    Variant("the send posted first, the requests waited in reverse", EXCHANGE + WAIT,
            "    requests = dist.batch_isend_irecv([dist.P2POp(dist.isend, outgoing, right),\n"
            "                                       dist.P2POp(dist.irecv, incoming, left)])\n"
            "    for request in reversed(requests):\n        request.wait()\n", 3),
]

# Right on gloo, wrong on a GPU machine: seen when the check runs it again on a stand-in GPU
MUTATIONS += [
    Mutation("the landing buffer on the CPU",
             "    landing = torch.empty_like(chunks[0])  # room for the largest chunk, allocated once\n",
             "    landing = torch.empty(chunks[0].numel(), dtype=tensor.dtype)\n",
             "a buffer of another device than the chunk it sent (made by `landing = torch.empty(", 3),
    Mutation("the flat gradients made on the CPU", "    flat = torch.cat([g.reshape(-1) for g in grads])\n",
             "    flat = torch.cat([g.reshape(-1).cpu() for g in grads])\n", "average_gradients (in train), run as on a GPU", 2),
]
