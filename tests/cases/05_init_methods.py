"""Chapter 05: the mistakes its check must name."""

from mutation import Mutation, Variant

SLOW = True  # each run waits out a 2 s rendezvous timeout, a wrong one up to 20 s

MUTATIONS = [
    Mutation("no timeout", ",\n                            world_size=settings.world_size, timeout=timedelta(seconds=settings.timeout_s))",
             ",\n                            world_size=settings.world_size)",
             "pass timeout=timedelta(seconds=settings.timeout_s)", 2),
    # REVIEW F: answered "pass timeout=" (already passed); torch's "rank parameter missing" was in a second line
    Mutation("no rank or world size for init_process_group",
             "init_method=settings.init_method, rank=settings.rank,\n                            world_size=settings.world_size, ",
             "init_method=settings.init_method, ", "pass rank=settings.rank and world_size=settings.world_size", 2),
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

MUTATIONS += [
    # REVIEW D: os.environ instead of the `environ` argument was blamed on LOCAL_RANK
    Mutation("os.environ instead of environ (rank)", 'else environ.get("RANK")', 'else os.environ.get("RANK")',
             "read the `environ` argument, not os.environ", 3),
    Mutation("os.environ instead of environ (MASTER_ADDR)", 'if not environ.get(name)]', 'if not os.environ.get(name)]',
             "read from the `environ` argument, not os.environ", 2),
    # REVIEW D: `or` treats rank 0 as missing
    Mutation("args.rank or RANK", 'rank = args.rank if args.rank is not None else environ.get("RANK")',
             'rank = args.rank or environ.get("RANK")', "--rank 0 was treated as missing", 2),
    # REVIEW D: check_fails_fast accepted any exception; a float timeout raises TypeError at once
    Mutation("timeout as a float, not a timedelta", "timeout=timedelta(seconds=settings.timeout_s))",
             "timeout=settings.timeout_s)", "instead of timing out", 2),
    Mutation("relative file:// path accepted", 'if not path.startswith("/"):', "if False:",
             "does not mention 'absolute'", 2),
    Mutation("missing folder accepted", "if not os.path.isdir(os.path.dirname(path)):", "if False:",
             "file:// in a missing folder was accepted", 2),
    Mutation("timeout 0 accepted", "if args.timeout <= 0:", "if args.timeout < 0:",
             "a timeout of 0 s was accepted", 2),
    # Inputs the lab's own run never uses: the ends of the port range, a file:// URL with a host
    Mutation("the top port refused (port < 65535)", "not 0 < port < 65536", "not 0 < port < 65535",
             "tcp:// at port 65535, the top of the range raised", 2),
    Mutation("port 0 accepted", "not 0 < port < 65536", "not 0 <= port < 65536",
             "tcp:// with port 0 was accepted", 3),
    Mutation("file:// path read by urlparse (the host dropped)", 'path = method[len("file://"):]',
             "path = urlparse(method).path", "file:// with a host (file://node1/tmp/rdzv) was accepted", 2),
]

NPROCS = (1, 2, 3, 4)  # each run waits out timeouts: 5 ranks adds 15 s and nothing new
NODES = True  # RANK, not LOCAL_RANK, is the rank in the group

CORRECT = [
    Variant("the scheme read by urlparse, the file path checked with pathlib",
            '    scheme = method.split("://", 1)[0] if "://" in method else ""\n',
            '    scheme = urlparse(method).scheme if "://" in method else ""\n', 2),
    Variant("the file path checked with pathlib",
            '        if not path.startswith("/"):\n',
            '        if not __import__("pathlib").PurePosixPath(path).is_absolute():\n', 2),
    Variant("rank and world size looked up in the environment first, the command line winning",
            '    rank = args.rank if args.rank is not None else environ.get("RANK")\n'
            '    world_size = args.world_size if args.world_size is not None else environ.get("WORLD_SIZE")\n',
            '    rank, world_size = environ.get("RANK"), environ.get("WORLD_SIZE")\n'
            '    if args.rank is not None:\n        rank = args.rank\n'
            '    if args.world_size is not None:\n        world_size = args.world_size\n', 2),
    Variant("the group joined by keywords, the timeout in milliseconds",
            '    dist.init_process_group("gloo", init_method=settings.init_method, rank=settings.rank,\n'
            '                            world_size=settings.world_size, timeout=timedelta(seconds=settings.timeout_s))\n',
            '    dist.init_process_group(backend="gloo", world_size=settings.world_size, rank=settings.rank,\n'
            '                            timeout=timedelta(milliseconds=1000 * settings.timeout_s),\n'
            '                            init_method=settings.init_method)\n', 2),
]

MUTATIONS += [
    # REVIEW B: an empty (not missing) environment variable; a negative number where 0 was tried
    Mutation("an empty MASTER_ADDR taken as set", "if not environ.get(name)]", "if name not in environ]",
             "env:// with an empty MASTER_ADDR was accepted", 2),
    Mutation("only a timeout of exactly 0 refused", "    if args.timeout <= 0:\n", "    if args.timeout == 0:\n",
             "a negative timeout (-5 s) was accepted", 2),
    Mutation("the rank's lower bound not tested", "not 0 <= rank < world_size", "not rank < world_size",
             "a negative rank was accepted", 2),
]
