"""The `speculant` command: one module per subcommand plus the shared options."""
