"""`tokenmill tune`: search engine settings for the Server scenario's peak (see search.py, cli.py)."""
