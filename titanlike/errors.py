"""The one exception for bad input, at the bottom of the package (every unit may import it): raised before anything
is built, printed as one line, exit code 2."""


class ConfigError(ValueError):
    """A bad configuration: the message is one line naming the key and the fix."""
