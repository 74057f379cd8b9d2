"""Subcommands of the ``attnkit`` CLI, one module each (see ``attnkit.cli``)."""
