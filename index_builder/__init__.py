"""Builds retrieval indexes from wiki-18 style corpora: `python -m index_builder --help`."""
