"""``python -m duetime``: the ``duetime`` command."""

from duetime.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
