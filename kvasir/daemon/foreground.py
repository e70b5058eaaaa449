"""``kvasird start`` and ``kvasird join`` in the foreground: SIGTERM and SIGINT only ask
the loop to stop, the loop does the work, and whatever happens everything made is
cleaned up; each returns the command's exit code."""

from __future__ import annotations

from kvasir.daemon.follower import Follower
from kvasir.daemon.launcher import Launcher, LaunchError, StartInterrupted
from kvasir.errors import KvasirError
from kvasir.signals import on_stop_signals


def run_launcher(launcher: Launcher) -> int:
    """Run the daemon in the foreground; the exit code for ``kvasird start``."""
    with on_stop_signals(launcher.request_stop):
        return _launch(launcher)


def _launch(launcher: Launcher) -> int:
    try:
        launcher.prepare()
        launcher.wait_hosts()
        launcher.spawn()
        launcher.notifier.status(f"loading {len(launcher.plan.all_stages)} stages")
        launcher.wait_ready()
        launcher.serve()
        launcher.log.info("stopped", code=launcher.exit_code)
        return launcher.exit_code
    except StartInterrupted:
        launcher.log.info("stopped during start-up")
        return 0
    except LaunchError as exc:
        launcher.log.error("start failed", error=str(exc))
        return 1
    finally:
        launcher.notifier.stopping("stopping")
        launcher.cleanup()
        launcher.notifier.close()


def run_follower(follower: Follower) -> int:
    """Run ``kvasird join`` in the foreground until SIGTERM or SIGINT; its exit code."""
    with on_stop_signals(follower.request_stop):
        try:
            follower.prepare()
            follower.run()
            follower.log.info("stopped")
            return 0
        except KvasirError as exc:
            follower.log.error("join failed", error=str(exc))
            return 1
        finally:
            follower.notifier.stopping("stopping")
            follower.cleanup()
            follower.notifier.close()
