"""`python -m tokenmill.server [serve options]`: same as `tokenmill serve`."""
import sys

from tokenmill.server.cli import main

if __name__ == "__main__":
    sys.exit(main())
