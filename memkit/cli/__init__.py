"""Command line: one module per subcommand (parse -> call library -> render)."""
