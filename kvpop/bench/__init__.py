"""`kvpop bench`: one module per subcommand (cli.py dispatches) and the helpers they share."""
