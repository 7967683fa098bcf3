"""The `jaxscale` command: `main` parses and dispatches, `commands/` holds one module per
subcommand, the rest are options several subcommands share. The top layer: nothing imports it."""
