"""`jaxscale` subcommands other than `train`, one module each (see jaxscale.cli.main.COMMAND_MODULES).

A module defines `register(subparsers)`: it adds its parser, whose options are checked by
argparse types from jaxscale.cli.main (`_number`), and sets `run=handler` where handler(args) -> int.
Errors are ValueError subclasses defined in jaxscale; cli.main turns them into one line, exit 2.
"""
