"""Chapter 03: the mistakes its check must name."""

from mutation import Mutation

MUTATIONS = [
    Mutation("broadcast rebinds the name instead of receiving in place",
             "        dist.recv(tensor, src=src)\n",
             "        tensor = torch.empty_like(tensor)\n        dist.recv(tensor, src=src)\n",
             "broadcast works in place", 2),
    Mutation("gather forgets the destination's own slot", "        gather_list[dst].copy_(tensor)\n", "",
             "the destination's own slot", 2),
    Mutation("all_gather forgets its own slot", "    tensor_list[rank].copy_(tensor)\n", "",
             "your own slot", 2),
    Mutation("all_gather receives into the wrong slot (off by one)",
             "recv_slot = (rank - step) % world_size, (rank - step - 1) % world_size",
             "recv_slot = (rank - step) % world_size, (rank - step + 1) % world_size",
             "off by one?", 4),
    # Blocking calls in a ring: every rank sends first, and on gloo a send waits for its recv.
    Mutation("all_gather with blocking send then recv on every rank",
             "        requests = [dist.isend(tensor_list[send_slot], dst=right), "
             "dist.irecv(tensor_list[recv_slot], src=left)]\n"
             "        for request in requests:\n            request.wait()\n",
             "        dist.send(tensor_list[send_slot], dst=right)\n"
             "        dist.recv(tensor_list[recv_slot], src=left)\n",
             "likely a deadlock", 2),
]
NPROCS = (2, 4)
