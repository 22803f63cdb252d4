"""CPU kernels of our own, in C++ built on first use with the system compiler and called through
ctypes: no build step at install, no torch headers, one shared library per source and flags, cached
(chip_child.cpu_kernels.build). Each checks itself against torch before it is used and, where it
cannot be built or disagrees, the caller keeps torch's op and says so on stderr."""
