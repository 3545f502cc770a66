"""Where does the store of torchrun's agent listen? Run it under torchrun --standalone.

    torchrun --standalone --nproc-per-node 1 assets/05_init_methods/agent_store.py

The agent hosts the rendezvous store at MASTER_PORT before it starts this process; the kernel's
table of listening sockets (/proc/net/tcp, what `ss -ltn` prints) says on which addresses.
"""

import os

from ringside.rendezvous import listening_addresses

port = int(os.environ["MASTER_PORT"])
addresses = listening_addresses(port) or []
print(f"something listens at MASTER_PORT: {bool(addresses)}")
print(f"on every interface, not only loopback: {any(a in ('::', '0.0.0.0') for a in addresses)}")
