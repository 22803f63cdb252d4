import sys

from chip_child.serve import main

main(sys.argv)
