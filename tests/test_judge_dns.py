"""A judge reached by host name, over verified TLS, with no thread (docs/ARCHITECTURE.md §1, §5).

Everything is local: tests/fake_judge.py serves https with a certificate for a made-up name
issued by a trustme CA, and a stub nameserver on 127.0.0.1 (asyncio UDP, dnspython's message
API) answers A for that name and NXDOMAIN for any other, counting the questions. The thread
count is the kernel's (/proc/self/task), so native threads count too; a control shows that it
does rise when aiohttp's default resolver looks a name up.
"""
from __future__ import annotations

import asyncio
import os
import socket
import ssl
from contextlib import asynccontextmanager

import aiohttp
import dns.message
import dns.rcode
import dns.rdatatype
import dns.rrset
import pytest
import trustme

from clawd.scoring import resolver as resolver_module
from clawd.scoring.judges import CallPolicy, JudgeFailed, OpenAIJudge
from clawd.scoring.resolver import LookupFailed, LoopResolver
from tests.fake_judge import FakeJudge, Reply

NAME = "judge.clawd.test"
FAST = CallPolicy(timeout=3.0, retries=2, backoff_initial=0.01, backoff_max=0.05, concurrency=4)
MESSAGES = [{"role": "user", "content": "Was it good?"}]


def os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


class StubDNS(asyncio.DatagramProtocol):
    """A nameserver for `records` ({name: (IPv4, TTL)}): A answered, AAAA empty, others NXDOMAIN."""

    def __init__(self, records: dict[str, tuple[str, int]]):
        self.records = {name.rstrip(".") + ".": value for name, value in records.items()}
        self.questions: list[tuple[str, str]] = []  # (name, type) in arrival order
        self.transport: asyncio.DatagramTransport | None = None

    async def start(self) -> StubDNS:
        loop = asyncio.get_running_loop()
        await loop.create_datagram_endpoint(lambda: self, local_addr=("127.0.0.1", 0))
        return self

    @property
    def address(self) -> str:
        return "127.0.0.1:%d" % self.transport.get_extra_info("sockname")[1]

    def connection_made(self, transport) -> None:
        self.transport = transport

    def datagram_received(self, data: bytes, addr) -> None:
        query = dns.message.from_wire(data)
        question = query.question[0]
        name = question.name.to_text().lower()
        self.questions.append((name, dns.rdatatype.to_text(question.rdtype)))
        reply = dns.message.make_response(query)
        if name not in self.records:
            reply.set_rcode(dns.rcode.NXDOMAIN)
        elif question.rdtype == dns.rdatatype.A:
            ip, ttl = self.records[name]
            reply.answer.append(dns.rrset.from_text(question.name, ttl, "IN", "A", ip))
        self.transport.sendto(reply.to_wire(), addr)

    def close(self) -> None:
        self.transport.close()


@pytest.fixture(scope="module")
def ca():
    return trustme.CA()


@pytest.fixture(scope="module")
def ca_file(ca, tmp_path_factory):
    path = tmp_path_factory.mktemp("ca") / "ca.pem"
    ca.cert_pem.write_to_path(str(path))
    return str(path)


def server_tls(ca: trustme.CA, name: str = NAME) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert(name).configure_cert(ctx)
    return ctx


@asynccontextmanager
async def world(ca: trustme.CA, records: dict[str, tuple[str, int]], *, name: str = NAME,
                default: Reply = Reply()):
    """The stub nameserver and the fake judge serving https for `name` with a certificate from `ca`."""
    stub = await StubDNS(records).start()
    try:
        async with FakeJudge(default, ssl_context=server_tls(ca, name), name=NAME) as fake:
            yield stub, fake
    finally:
        stub.close()


@asynccontextmanager
async def no_getaddrinfo():
    """Any name lookup through the loop (the road to its thread pool) fails the test."""
    loop = asyncio.get_running_loop()
    calls = []

    async def refuse(*args, **kwargs):
        calls.append(args)
        raise AssertionError(f"loop.getaddrinfo{args}")

    loop.getaddrinfo = refuse
    try:
        yield calls
    finally:
        del loop.getaddrinfo


async def test_a_judge_by_name_answers_over_verified_tls_with_no_thread(ca, ca_file):
    # Connection: close makes every call open a new connection, so every call asks the resolver.
    async with world(ca, {NAME: ("127.0.0.1", 60)}, default=Reply(headers={"Connection": "close"})) as (stub, fake):
        baseline = os_threads()
        async with no_getaddrinfo() as getaddrinfo_calls:
            judge = OpenAIJudge(fake.url, "k", "judge-model", policy=FAST, ca_file=ca_file,
                                nameserver=stub.address)
            async with judge:
                assert await judge.complete(MESSAGES) == "\\boxed{1}"
                assert sorted(stub.questions) == [(NAME + ".", "A"), (NAME + ".", "AAAA")]
                for _ in range(4):
                    assert await judge.complete(MESSAGES) == "\\boxed{1}"
        assert len(fake.peers) == 5  # five connections, five lookups ...
        assert len(stub.questions) == 2  # ... answered from the first, within its TTL
        assert fake.requests[0][0]["Host"] == f"{NAME}:{fake.port}"
        assert judge.stats.ok == 5 and judge.stats.connection_errors == 0
        assert getaddrinfo_calls == []
        assert os_threads() == baseline


async def test_the_thread_count_sees_aiohttps_default_resolver_thread():
    # The control: the count above would rise if a lookup went through a thread.
    loop = asyncio.get_running_loop()
    baseline = os_threads()
    resolver = aiohttp.ThreadedResolver()
    try:
        await resolver.resolve("localhost", 80)
    except OSError:
        pass  # resolved or not, getaddrinfo ran in the loop's thread pool
    assert os_threads() > baseline
    await loop.shutdown_default_executor()
    await resolver.close()


async def test_an_unknown_name_is_a_retried_dns_failure_naming_the_host(ca, ca_file):
    async with world(ca, {NAME: ("127.0.0.1", 60)}) as (stub, fake):
        url = fake.url.replace(NAME, "missing.clawd.test")
        async with OpenAIJudge(url, "k", "m", policy=FAST, ca_file=ca_file, nameserver=stub.address) as judge:
            with pytest.raises(JudgeFailed) as failed:
                await judge.complete(MESSAGES)
    assert failed.value.reason == "dns"
    assert failed.value.detail == "missing.clawd.test: no such name (NXDOMAIN)"
    s = judge.stats
    assert (s.failed, s.connection_errors, s.retried) == (1, FAST.retries + 1, FAST.retries)
    assert fake.requests == []
    assert len(stub.questions) == 2 * (FAST.retries + 1)  # failures are not cached: each attempt asks


@pytest.mark.parametrize("case", ["other CA", "system store", "other name"])
async def test_a_certificate_that_does_not_verify_is_refused_without_retry(ca, ca_file, case):
    issuer, name, trust = {"other CA": (trustme.CA(), NAME, ca_file), "system store": (ca, NAME, ""),
                           "other name": (ca, "other.clawd.test", ca_file)}[case]
    async with world(issuer, {NAME: ("127.0.0.1", 60)}, name=name) as (stub, fake):
        async with OpenAIJudge(fake.url, "k", "m", policy=FAST, ca_file=trust, nameserver=stub.address) as judge:
            with pytest.raises(JudgeFailed) as failed:
                await judge.complete(MESSAGES)
    assert failed.value.reason == "tls" and failed.value.detail.startswith(NAME + ": ")
    assert "certificate verify failed" in failed.value.detail
    assert (judge.stats.connection_errors, judge.stats.retried) == (1, 0)
    assert fake.requests == []


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_the_resolver_keeps_answers_for_their_ttl_capped_and_shares_lookups(monkeypatch):
    stub = await StubDNS({"a.test": ("10.0.0.1", 60), "zero.test": ("10.0.0.2", 0),
                          "long.test": ("10.0.0.3", 86400)}).start()
    clock = Clock()
    res = LoopResolver(("127.0.0.1", int(stub.address.split(":")[1])))
    monkeypatch.setattr(res, "clock", clock)
    try:
        found = await res.resolve("a.test", 443, family=socket.AF_UNSPEC)
        assert [(r["host"], r["port"], r["family"], r["hostname"]) for r in found] == [
            ("10.0.0.1", 443, socket.AF_INET, "a.test")]
        clock.now += 59
        await res.resolve("a.test", 443, family=socket.AF_UNSPEC)
        assert len(stub.questions) == 2  # A and AAAA, once
        clock.now += 2
        await res.resolve("a.test", 443, family=socket.AF_UNSPEC)
        assert len(stub.questions) == 4  # expired: asked again

        stub.questions.clear()
        await res.resolve("zero.test", 80, family=socket.AF_INET)
        await res.resolve("zero.test", 80, family=socket.AF_INET)
        assert stub.questions == [("zero.test.", "A")] * 2  # TTL 0: not kept; A only for AF_INET

        stub.questions.clear()
        await res.resolve("long.test", 80, family=socket.AF_INET)
        clock.now += resolver_module.MAX_TTL + 1
        await res.resolve("long.test", 80, family=socket.AF_INET)
        assert len(stub.questions) == 2  # a day's TTL is kept MAX_TTL at most

        stub.questions.clear()
        clock.now += resolver_module.MAX_TTL + 1
        answers = await asyncio.gather(*(res.resolve("a.test", 80, family=socket.AF_INET) for _ in range(8)))
        assert len(stub.questions) == 1 and all(a[0]["host"] == "10.0.0.1" for a in answers)

        with pytest.raises(LookupFailed, match="^nothing.test: no such name"):
            await res.resolve("nothing.test", 80)
        assert res._pending == {}
    finally:
        await res.close()
        stub.close()


async def test_a_silent_nameserver_fails_the_lookup_within_its_lifetime(monkeypatch):
    silent = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)  # bound, never answers
    silent.bind(("127.0.0.1", 0))
    monkeypatch.setattr(resolver_module, "LIFETIME", 0.3)
    res = LoopResolver(silent.getsockname())
    try:
        with pytest.raises(LookupFailed, match="^judge.clawd.test: no answer from the nameservers within 0.3 s"):
            await res.resolve(NAME, 443)
    finally:
        await res.close()
        silent.close()


def test_configuration_errors_are_named(tmp_path):
    with pytest.raises(ValueError, match="judge nameserver 'dns.example' must be an IP address"):
        OpenAIJudge(f"https://{NAME}/v1", "k", "m", nameserver="dns.example")
    with pytest.raises(ValueError, match="judge ca_file .*missing.pem"):
        OpenAIJudge(f"https://{NAME}/v1", "k", "m", ca_file=str(tmp_path / "missing.pem"))
    (tmp_path / "junk.pem").write_text("not a certificate\n")
    with pytest.raises(ValueError, match="judge ca_file .*junk.pem"):
        OpenAIJudge(f"https://{NAME}/v1", "k", "m", ca_file=str(tmp_path / "junk.pem"))


@pytest.mark.skipif(not os.path.exists("/etc/resolv.conf"), reason="no /etc/resolv.conf here")
def test_no_nameserver_means_the_systems_resolv_conf():
    import dns.resolver
    judge = OpenAIJudge(f"https://{NAME}/v1", "k", "m")
    assert judge._resolver.nameservers == [str(ns) for ns in dns.resolver.Resolver().nameservers]


async def test_the_daemon_scores_with_a_judge_reached_by_name_and_starts_no_thread(tiny_model, tmp_path, ca, ca_file):
    """The whole daemon, its judge set by host name: turns are scored over verified TLS, the stub nameserver
    is asked, and the daemon's OS thread count (/proc/<pid>/task, through /debug/process) stays 1."""
    import openai

    from tests.fake_sglang import FakeSGLang
    from tests.harness import Daemon, wait_ready_async

    async with world(ca, {NAME: ("127.0.0.1", 60)}) as (stub, judge), FakeSGLang() as engine:
        daemon = Daemon(tmp_path, {
            "model": {"path": str(tiny_model)},
            "engine": {"launch": "none", "url": engine.url, "health_interval": 0.2},
            "judge": {"backend": "openai", "url": f"https://{NAME}:{judge.port}/v1", "model": "prm",
                      "ca_file": ca_file, "nameserver": stub.address, "timeout": 10.0}}, wait_ready=False)
        try:
            await wait_ready_async(daemon)
            client = openai.AsyncOpenAI(base_url=daemon.url + "/v1", api_key="none", max_retries=0)
            for i in range(3):
                messages = [{"role": "user", "content": f"Question {i}?"}]
                reply = await client.chat.completions.create(model="m", messages=messages)
                messages += [reply.choices[0].message.model_dump(exclude_none=True),
                             {"role": "user", "content": "Thanks!"}]
                await client.chat.completions.create(model="m", messages=messages,
                                                     extra_headers={"X-Session-Done": "1"})
            await client.close()
            for _ in range(400):
                process = daemon.get("/debug/process")[1]
                if process["scoring"]["votes"].get("+1", 0) >= 3:
                    break
                await asyncio.sleep(0.05)
            assert process["scoring"]["votes"] == {"+1": 3}, process["scoring"]  # each judged over TLS
            assert len(judge.requests) == 3 and (NAME + ".", "A") in stub.questions
            assert (process["threads"], process["os_threads"]) == (1, 1), process
        finally:
            assert daemon.stop() == 0
