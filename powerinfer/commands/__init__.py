"""CLI subcommands; each module has add_arguments(parser) and run(args)."""
