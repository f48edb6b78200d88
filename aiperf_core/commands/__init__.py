"""One module per `aiperf` subcommand: HELP, add_arguments(parser), run(args) -> exit status."""
