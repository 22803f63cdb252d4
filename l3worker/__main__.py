"""`python -m l3worker serve ...`"""
import sys

from l3worker.server.cli import main

sys.exit(main())
