"""``kns chaos``: bounded fault scenarios against a stack of its own, measured token by token."""
