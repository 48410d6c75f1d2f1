"""One module per `eviback` subcommand: `HELP`, `add_arguments(parser)`, `run(args) -> int`.

Modules here stay thin: they parse arguments and call the library. Heavy imports happen inside `run`."""
