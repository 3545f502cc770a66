"""Chapter 04: the mistakes its check must name."""

from mutation import Mutation

MUTATIONS = [
    Mutation("off-by-one chunk index",
             "send, receive = (rank - step) % world_size, (rank - step - 1) % world_size",
             "send, receive = (rank - step) % world_size, (rank - step + 1) % world_size",
             "an off-by-one chunk index?", 4),
    Mutation("remainder chunk dropped",
             "sizes = [base + (1 if i < extra else 0) for i in range(world_size)]",
             "sizes = [base for i in range(world_size)]",
             "the remainder chunk dropped?", 4),
    Mutation("no division by world_size", "    flat /= world_size\n", "",
             "did you divide by world_size?", 2),
    Mutation("blocking recv before send deadlocks",
             "    requests = [dist.isend(outgoing, dst=right), dist.irecv(incoming, src=left)]\n"
             "    for request in requests:\n        request.wait()\n",
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
]
