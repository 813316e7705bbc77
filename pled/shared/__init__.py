"""What the daemon and its clients share: the region's format, the wire protocol, errors, sizes.
Standard library only (numpy for the reference dequantizer); imports neither side."""
