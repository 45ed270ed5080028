"""CLI subcommands, one module per group; imported lazily by `dflash_zoo.cli`."""
