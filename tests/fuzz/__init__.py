"""Malformed input against the native relay pump, also under AddressSanitizer (``nox -s fuzz``)."""
