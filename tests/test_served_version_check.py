"""benchmarks/served_version_check.py cuts a response into spans of one version label."""

from benchmarks.served_version_check import segments


def test_segments_split_policy_tokens_by_version_and_skip_the_rest():
    versions = [-1, -1, 3, 3, 4, 4, -1, 4, 5]
    mask = [0, 0, 1, 1, 1, 1, 0, 1, 1]
    # the tool/prompt token at 6 breaks the span of version 4 in two
    assert segments(versions, mask) == [(3, 2, 4), (4, 4, 6), (4, 7, 8), (5, 8, 9)]
    assert segments([0, 0], [0, 0]) == []
