"""Configuration: etc/clawd.toml as frozen dataclasses (docs/ARCHITECTURE.md §9).

One module per section of the file, named after it (`clawd.config.server` holds [server]); `schema` holds
the whole and the checks across sections, `loading` reads a file into it.
"""
