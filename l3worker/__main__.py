"""`python -m l3worker serve ...`"""
import sys

from l3worker.serving.cli import main

sys.exit(main())
