"""configs/server.py: the server's settings, whose fields carry the `serve` flags."""

from __future__ import annotations

import argparse

import pytest

from omnistage.configs.server import ServerSettings, server_flags


def test_defaults_equal_the_limit_records_the_server_builds() -> None:
    from omnistage.entrypoints.openai.api_server import ServerConfig
    from omnistage.entrypoints.openai.media import MediaPolicy
    from omnistage.entrypoints.openai.realtime.connection import RealtimeLimits
    from omnistage.entrypoints.openai.slow_clients import ConnectionLimits
    from omnistage.entrypoints.openai.video_params import VideoLimits

    config = ServerConfig()
    assert config.video_limits == VideoLimits()
    assert config.connection_limits == ConnectionLimits()
    assert (config.realtime_limits.max_buffer_bytes, config.realtime_limits.max_turn_s,
            config.realtime_limits.idle_timeout_s, config.realtime_limits.resume_grace_s) == (
        RealtimeLimits().max_buffer_bytes, RealtimeLimits().max_turn_s,
        RealtimeLimits().idle_timeout_s, RealtimeLimits().resume_grace_s)
    assert ServerConfig(realtime_resume_grace_s=0).realtime_limits.resume_grace_s == 0
    assert config.media_policy == MediaPolicy()


def test_from_namespace_maps_values_as_the_metadata_says() -> None:
    args = argparse.Namespace(default_modalities="text, audio,", allowed_origins=["*"],
                              port=9000, max_queue=None)
    s = ServerSettings.from_namespace(args)
    assert s.default_modalities == ("text", "audio")
    assert s.allowed_origins == ("*",)
    assert (s.port, s.max_queue) == (9000, 256)


def test_every_flag_has_help_and_a_dashed_name() -> None:
    for flag in server_flags():
        assert flag.help and flag.flag.startswith("--") and "_" not in flag.flag, flag


def test_bad_values_are_refused_with_the_field_name() -> None:
    with pytest.raises(ValueError, match="max_queue=0"):
        ServerSettings(max_queue=0)
    with pytest.raises(ValueError, match="default_modalities: 'video'"):
        ServerSettings(default_modalities=("video",))
