"""The two ways a launch goes wrong: refused before anything starts, or started and never became ready."""


class LaunchConfigError(ValueError):
    """Settings the launcher refuses (lossy speculation, contradictory sizes, ...); nothing was started."""


class ServerStartError(RuntimeError):
    """The server exited or never answered its health check in time; the message carries its log tail."""


def require(condition: bool, message: str) -> None:
    if not condition:
        raise LaunchConfigError(message)
