"""Chapter 02: the mistakes its check must name."""

from mutation import Mutation, Variant

HALO = ("    return dist.batch_isend_irecv([\n"
        "        dist.P2POp(dist.isend, local[-width:].contiguous(), right),  # travels right ...\n"
        "        dist.P2POp(dist.irecv, left_halo, left),  # ... and so does what the left neighbour sends us\n"
        "        dist.P2POp(dist.isend, local[:width].contiguous(), left),  # travels left\n"
        "        dist.P2POp(dist.irecv, right_halo, right),\n"
        "    ])\n")


def halo(*lines: str, wrap: str = "batch") -> str:
    if wrap == "batch":
        return "    return dist.batch_isend_irecv([\n" + "".join(f"        {x},\n" for x in lines) + "    ])\n"
    return "    return [\n" + "".join(f"        {x},\n" for x in lines) + "    ]\n"


SEND_RIGHT = "dist.P2POp(dist.isend, local[-width:].contiguous(), right)"
RECV_LEFT = "dist.P2POp(dist.irecv, left_halo, left)"
SEND_LEFT = "dist.P2POp(dist.isend, local[:width].contiguous(), left)"
RECV_RIGHT = "dist.P2POp(dist.irecv, right_halo, right)"

MUTATIONS = [
    # REVIEW 6: right at 3 and 4 ranks, swapped at 2 (which the docstring asks for): seen at 4 from the order posted
    Mutation("left-going edge posted first, left halo first", HALO, halo(SEND_LEFT, RECV_LEFT, SEND_RIGHT, RECV_RIGHT),
             "at 2 ranks (which the docstring asks for)", 4),
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
    Mutation("rank 0 never takes the token back",
             "        dist.send(token, dst=right)\n        dist.recv(token, src=left)\n",
             "        dist.send(token, dst=right)\n        dist.recv(token.clone(), src=left)\n",
             "rank 0 must receive the token back", 3),
    # At 2 ranks both neighbours are one process: the posting order decides which halo is which.
    Mutation("halos posted receives first (2 ranks: swapped)", HALO, halo(RECV_LEFT, RECV_RIGHT, SEND_LEFT, SEND_RIGHT),
             "match in the order they are posted", 2),
    Mutation("wrong edge sent", HALO,
             halo(SEND_RIGHT.replace("[-width:]", "[:width]"), RECV_LEFT, SEND_LEFT.replace("[:width]", "[-width:]"),
                  RECV_RIGHT),
             "you sent the wrong edge", 4),
    Mutation("edge slice off by one", HALO, halo(SEND_RIGHT, RECV_LEFT, SEND_LEFT.replace("[:width]", "[1:width + 1]"),
                                                 RECV_RIGHT),
             "shifted by one element (off by one)", 3),
    # REVIEW D: tags named after the buffer got "likely a deadlock" without a word of tags
    Mutation("tags named after the halo, not the direction", HALO, halo(
        "dist.isend(local[-width:].contiguous(), dst=right, tag=1)", "dist.irecv(left_halo, src=left, tag=0)",
        "dist.isend(local[:width].contiguous(), dst=left, tag=0)", "dist.irecv(right_halo, src=right, tag=1)",
        wrap="list"), "NCCL ignores tags", 3),
    # Right on gloo, wrong on NCCL: tags for the direction, isend/irecv one by one
    Mutation("tags for the direction (gloo only)", HALO, halo(
        "dist.irecv(left_halo, src=left, tag=0)", "dist.irecv(right_halo, src=right, tag=1)",
        "dist.isend(local[:width].contiguous(), dst=left, tag=1)",
        "dist.isend(local[-width:].contiguous(), dst=right, tag=0)", wrap="list"), "NCCL ignores tags", 2),
    Mutation("isend/irecv one by one", HALO, halo(
        "dist.isend(local[-width:].contiguous(), dst=right)", "dist.irecv(left_halo, src=left)",
        "dist.isend(local[:width].contiguous(), dst=left)", "dist.irecv(right_halo, src=right)", wrap="list"),
        "posted together with dist.batch_isend_irecv", 3),
    # REVIEW D: waiting inside start_halo_exchange passed (the overlap was never checked)
    Mutation("waits inside start_halo_exchange", HALO,
             HALO.replace("    return dist.batch_isend_irecv([", "    requests = dist.batch_isend_irecv([")
             + "    for request in requests:\n        request.wait()\n    return requests\n",
             "waited for its requests before returning", 2),
    # REVIEW D: returning only the receive requests passed
    Mutation("returns only the receive requests", HALO,
             HALO.replace("    return dist.batch_isend_irecv([", "    requests = dist.batch_isend_irecv([")
             + "    return requests[1::2]\n",
             "did not return the requests of its isends", 2),
    Mutation("halo received into a new tensor", HALO,
             "    left_halo = torch.empty_like(left_halo)\n" + HALO,
             "did not receive into left_halo and right_halo themselves", 2),
    # Learner trial: each of these got only "timed out ... likely a deadlock", a store error, or a
    # diagnosis that blamed the wrong calls; float32 passed at 4 ranks.
    Mutation("right neighbour without % world_size",
             "left, right = (rank - 1) % world_size, (rank + 1) % world_size\n    token",
             "left, right = (rank - 1) % world_size, rank + 1\n    token",
             "rank 3 sends the token to rank 4, which does not exist", 4),
    Mutation("last rank never sends the token back",
             "        token = token * 10 + rank + 1\n        dist.send(token, dst=right)\n",
             "        token = token * 10 + rank + 1\n        if rank < world_size - 1:\n"
             "            dist.send(token, dst=right)\n",
             "the last rank (rank 3) must send the token on to rank 0", 4),
    Mutation("float32 token", "    token = torch.ones(1, dtype=torch.int64, device=device)\n",
             "    token = torch.ones(1, device=device)\n",
             "float32 holds whole numbers exactly only up to 16777216", 4),
    Mutation("every rank sends first",
             "        dist.recv(token, src=left)\n        token = token * 10 + rank + 1\n        dist.send(token, dst=right)\n",
             "        dist.send(token, dst=right)\n        dist.recv(token, src=left)\n        token = token * 10 + rank + 1\n",
             "all wait in send", 3),
    Mutation("halo receives crossed (sends right)", HALO, halo(SEND_RIGHT, RECV_LEFT.replace("left)", "right)"), SEND_LEFT,
                                                               RECV_RIGHT.replace("right)", "left)")),
             "the receives are crossed", 4),
    Mutation("one halo received from the wrong neighbour", HALO,
             halo(SEND_RIGHT, RECV_LEFT, SEND_LEFT, RECV_RIGHT.replace("right)", "left)")),
             "the exchange would wait for ever", 3),
]
NPROCS = (2, 3, 4, 5)
REFUSES = (1,)  # a ring of one rank has no neighbour

# Right code written otherwise: the check must pass it (found by trying it as a learner might).
CORRECT = [
    Variant("digit appended in place", "        token = token * 10 + rank + 1\n",
            "        token.mul_(10).add_(rank + 1)\n", 3),
]

TOKEN_RING = ("    if rank == 0:\n        dist.send(token, dst=right)\n        dist.recv(token, src=left)\n    else:\n"
              "        dist.recv(token, src=left)\n        token = token * 10 + rank + 1\n        dist.send(token, dst=right)\n")
HALO_POSTS = ("        dist.P2POp(dist.isend, local[-width:].contiguous(), right),  # travels right ...\n"
              "        dist.P2POp(dist.irecv, left_halo, left),  # ... and so does what the left neighbour sends us\n"
              "        dist.P2POp(dist.isend, local[:width].contiguous(), left),  # travels left\n"
              "        dist.P2POp(dist.irecv, right_halo, right),\n")
CORRECT += [
    Variant("the ring with isend/irecv, each waited at once", TOKEN_RING,
            "    if rank == 0:\n        dist.isend(token, dst=right).wait()\n        dist.irecv(token, src=left).wait()\n"
            "    else:\n        dist.irecv(token, src=left).wait()\n        token = token * 10 + rank + 1\n"
            "        dist.isend(token, dst=right).wait()\n", 3),
    Variant("the new token made from a Python int", "        token = token * 10 + rank + 1\n",
            "        token = torch.tensor([int(token.item()) * 10 + rank + 1], device=device)\n", 3),
    Variant("both receives posted first, then both sends (each direction in the same order)", HALO_POSTS,
            "        dist.P2POp(dist.irecv, left_halo, left),\n        dist.P2POp(dist.irecv, right_halo, right),\n"
            "        dist.P2POp(dist.isend, local[-width:].clone(), right),\n"
            "        dist.P2POp(dist.isend, local[:width].clone(), left),\n", 2),
]

MUTATIONS += [
    # REVIEW B: an argument at one value only (the lab's own run uses width=2)
    Mutation("halo width written as 2", HALO_POSTS,
             HALO_POSTS.replace("local[-width:]", "local[-2:]").replace("local[:width]", "local[:2]"),
             "sends 2 elements: a halo holds `width` of them", 2),
]

# Right on gloo, wrong on a GPU machine: seen when the check runs it again on a stand-in GPU
MUTATIONS += [
    Mutation("the token made without device=", "    token = torch.ones(1, dtype=torch.int64, device=device)\n",
             "    token = torch.ones(1, dtype=torch.int64)\n",
             "is made by `token = torch.ones(1, dtype=torch.int64)`", 2),
]
