"""The one error of pled's boundary (pled.shared.boundary, pled.shared.regular_files): a module of its own, so
that both can raise it without importing each other."""


class BoundaryError(ValueError):
    """Input refused at the boundary; the message says what is wrong, without naming the file."""
