"""Built-in adapters for real APIs, one module each, chosen by ``kind`` (see :mod:`jobtrail.providers.kinds`)."""
