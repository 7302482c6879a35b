"""The one exception for bad input, at the bottom of the package (every unit may import it): raised before anything
is built, printed as one line, exit code 2."""


class ConfigError(ValueError):
    """A bad configuration: the message is one line naming the key and the fix."""

    @classmethod
    def of(cls, problems: list[str], where: str | None = None) -> "ConfigError":
        """Every problem of an input in one line (numbered when there are several), after ``where`` if given."""
        if len(problems) == 1:
            return cls(f"{where}: {problems[0]}" if where else problems[0])
        listed = "; ".join(f"({i}) {p}" for i, p in enumerate(problems, 1))
        return cls(f"{where}: {len(problems)} problems: {listed}" if where else f"{len(problems)} problems: {listed}")
