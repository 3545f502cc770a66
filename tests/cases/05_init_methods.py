"""Chapter 05: the mistakes its check must name."""

from mutation import Mutation

MUTATIONS = [
    Mutation("no timeout", ",\n                            world_size=settings.world_size, timeout=timedelta(seconds=settings.timeout_s))",
             ",\n                            world_size=settings.world_size)",
             "pass timeout=timedelta(seconds=settings.timeout_s)", 2),
    Mutation("LOCAL_RANK for RANK", 'else environ.get("RANK")', 'else environ.get("LOCAL_RANK")',
             "the global rank is RANK", 2),
    Mutation("no MASTER_ADDR check", 'for name in ("MASTER_ADDR", "MASTER_PORT")', 'for name in ("MASTER_PORT",)',
             "env:// without MASTER_ADDR was accepted", 2),
    Mutation("no port check", "port is None or not 0 < port < 65536", "False",
             "tcp:// without a port was accepted", 2),
    Mutation("rank range off by one", "not 0 <= rank < world_size", "not 0 <= rank <= world_size",
             "rank 4 in a world of 4 was accepted", 2),
    Mutation("environment wins", 'rank = args.rank if args.rank is not None else environ.get("RANK")',
             'rank = int(environ["RANK"]) if "RANK" in environ else args.rank',
             "the command line must win over the environment", 2),
]
