"""Who a request counts as: key names, the one "anonymous" principal of an open API, the opt-in to
trusting `user` (cut to its cap), keys compared as digests, and an open API refused off loopback."""
from __future__ import annotations

import openai
import pytest
from aiohttp.test_utils import make_mocked_request

from clawd.config.loading import config_from_dict, ConfigError
from clawd.serving.auth import ANONYMOUS, Authenticator
from clawd.serving.errors import ApiError

from .fake_sglang import FakeSGLang
from .harness import Daemon, wait_ready_async
from .test_api import Script


def _auth(**auth) -> Authenticator:
    return Authenticator(config_from_dict({"auth": auth}))


def _request(token: str | None):
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    return make_mocked_request("POST", "/v1/chat/completions", headers=headers)


def test_with_no_keys_every_request_is_anonymous_whatever_its_user_field():
    auth = _auth()
    assert auth.principal(_request(None)) is None
    assert [auth.principal_for(None, u) for u in ("alice", "bob", "", None)] == [ANONYMOUS] * 4


def test_a_trusted_user_field_is_the_principal_cut_to_its_cap():
    auth = _auth(trust_user_field=True, max_user_chars=5)
    assert auth.principal_for(None, "alice-and-more") == "alice"
    assert auth.principal_for(None, "") == ANONYMOUS and auth.principal_for(None, None) == ANONYMOUS


def test_a_key_name_wins_over_the_user_field():
    auth = _auth(keys=[{"name": "alice", "key": "sk-alice-123456"}], trust_user_field=True)
    assert auth.principal_for(auth.principal(_request("sk-alice-123456")), "mallory") == "alice"


@pytest.mark.parametrize("token", ["sk-alice-12345", "sk-alice-1234567", "sk-alice-123456 x", "SK-ALICE-123456"])
def test_near_miss_keys_are_refused(token):
    auth = _auth(keys=[{"name": "alice", "key": "sk-alice-123456"}])
    with pytest.raises(ApiError) as exc:
        auth.principal(_request(token))
    assert exc.value.status == 401


def test_keys_are_held_as_fixed_size_digests():
    auth = _auth(keys=[{"name": "a", "key": "short-key"}, {"name": "b", "key": "a-much-longer-key-" * 8}])
    assert {len(digest) for _, digest in auth.keys} == {32}  # nothing of a key's length is compared


def test_an_open_api_off_loopback_is_refused_unless_allowed():
    with pytest.raises(ConfigError, match="auth.keys.*allow_open"):
        config_from_dict({"server": {"host": "0.0.0.0"}})
    assert config_from_dict({"server": {"host": "0.0.0.0"}, "auth": {"allow_open": True}}).auth.allow_open
    assert config_from_dict({"server": {"host": "::1"}}).server.loopback
    keyed = {"server": {"host": "10.0.0.5"}, "auth": {"keys": [{"name": "a", "key": "sk-a-123456"}]}}
    assert not config_from_dict(keyed).server.loopback


@pytest.mark.parametrize("trust", [False, True])
async def test_rotating_user_values_do_not_make_principals_unless_trusted(tiny_model, tmp_path, trust):
    script = Script(tiny_model)
    async with FakeSGLang(responder=script, eos_id=script.eos) as fake:
        daemon = Daemon(tmp_path, {"model": {"path": str(tiny_model)},
                                   "engine": {"launch": "none", "url": fake.url},
                                   "auth": {"trust_user_field": trust, "max_user_chars": 8}},
                        wait_ready=False)
        try:
            await wait_ready_async(daemon)
            client = openai.AsyncOpenAI(base_url=daemon.url + "/v1", api_key="none", max_retries=0)
            for n in range(3):
                await client.chat.completions.create(model="m", messages=[{"role": "user", "content": f"q{n}"}],
                                                     user=f"rotating-user-{n}", extra_headers={"X-Session-Done": "1"})
            await client.close()
            principals = sorted(r["principal"] for r in daemon.records())
            assert principals == (["rotating"] * 3 if trust else [ANONYMOUS] * 3)
        finally:
            assert daemon.stop() == 0
