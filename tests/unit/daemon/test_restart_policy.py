from kvasir.daemon.supervision import Heartbeats, RestartPolicy


def test_first_failure_restarts_at_once_then_backs_off_doubling():
    policy = RestartPolicy(max_restarts=4, window_s=100.0, backoff_s=1.0, backoff_max_s=3.0)
    assert [policy.failed(t) for t in (0.0, 1.0, 2.0, 3.0)] == [0.0, 1.0, 2.0, 3.0]  # capped at 3
    assert policy.failed(4.0) is None  # the fifth failure within the window: give up


def test_failures_older_than_the_window_are_forgotten():
    policy = RestartPolicy(max_restarts=1, window_s=10.0)
    assert policy.failed(0.0) == 0.0
    assert policy.failed(10.5) == 0.0  # the first one left the window
    assert policy.failed(11.0) is None


def test_zero_restarts_means_give_up_on_the_first_failure():
    assert RestartPolicy(max_restarts=0, window_s=10.0).failed(0.0) is None


def test_heartbeats_find_only_watched_silent_children():
    beats = Heartbeats(timeout_s=2.0)
    beats.beat("stage-0", 0.0)  # not watched yet (still loading): ignored
    beats.watch("stage-0", 1.0)
    beats.watch("bridge", 1.0)
    beats.beat("bridge", 2.5)
    assert beats.silent(2.9) is None
    name, quiet = beats.silent(3.5)
    assert name == "stage-0" and quiet == 2.5
    beats.forget("stage-0")
    assert beats.silent(4.0) is None
    assert beats.silent(4.6)[0] == "bridge"


def test_a_pause_of_the_launcher_itself_is_not_counted_as_silence():
    beats = Heartbeats(timeout_s=2.0)
    beats.watch("stage-0", 0.0)
    for now in (0.1, 0.2, 0.3):
        assert beats.silent(now) is None
    # the whole group was stopped for 60 s: on resume the launcher looks before any beat
    assert beats.silent(60.3) is None
    for now in (60.8, 61.3, 61.8):
        assert beats.silent(now) is None
    name, quiet = beats.silent(62.2)  # silent for 2.2 s of the launcher's own watching: hung
    assert name == "stage-0" and abs(quiet - 2.2) < 1e-9
    beats.beat("stage-0", 62.5)
    assert beats.silent(62.6) is None
