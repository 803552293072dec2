"""The shared pipeline room's answer to "which schedule do the flags ask for" (which.py) is the
features' own: --moe-fb-overlap's and DualPipeV's `enabled` delegate to it, and it reads the
flags' argparse destinations, so a renamed Config field would make it answer False. Parsed here
with npuspeed's own parser, every way each flag can be given."""
from __future__ import annotations

import pytest

from npuspeed.arguments import parse_args
from npuspeed.features import all_features
from npuspeed.features.pipeline import which

CASES = [
    ([], False, False),
    (["--moe-fb-overlap"], True, False),
    (["--overlap-moe-expert-parallel-comm"], True, False),
    (["--schedules-method", "dualpipev"], False, True),
    (["--schedules-method", "dualpipev", "--moe-fb-overlap"], True, True),
]


@pytest.mark.parametrize("argv, overlap, v", CASES)
def test_which_reads_the_features_flags(argv, overlap, v):
    features = all_features()
    args = parse_args(features, argv)
    assert which.pairs_overlap(args) is overlap
    assert which.v_schedule(args) is v
    on = {f.name for f in features if f.enabled(args)}
    assert ("moe_fb_overlap" in on) is overlap and ("dualpipev" in on) is v


def test_the_fields_it_reads_are_the_features_config_fields():
    from dataclasses import fields

    by_name = {f.name: {x.name for x in fields(f.Config)} for f in all_features()}
    assert {"moe_fb_overlap", "overlap_moe_expert_parallel_comm"} <= by_name["moe_fb_overlap"]
    assert "schedules_method" in by_name["dualpipev"]
