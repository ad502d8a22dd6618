"""The chat page of `jaxlm serve` (GET /) in a real headless Chromium, Debian's chromium and chromium-driver driven by
selenium (`make browser` installs them, and socat), against servers of two tiny models: a char model that learned one
answer holding Markdown and a <script> element by heart, and the random Gemma 3 vision-language model of
tests/test_serve_vision.py behind an API key. The page's streamed answer equals the API's greedy answer to the
request the page sent (read from the browser's network log), the script renders as text, Stop frees the slot, a
reload keeps the conversation, an image (file picker and paste) is answered, a wrong key, a 400, an error event
mid-stream and an image for the text model show one line, the page's headers and same-origin rule hold, and the page
works over serve.uds through the socat line `jaxlm serve` prints. Screenshots of
the page go to outputs/browser/ (JAXLM_TEST_ARTIFACTS names another folder)."""

import base64
import json
import os
import re
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

from conftest import require

openai = require("openai")
require("fastapi")
webdriver = require("selenium.webdriver")

from jaxlm import serve  # noqa: E402
from jaxlm.serve import chat_page  # noqa: E402
from test_serve_vision import png, start, vlm  # noqa: E402,F401 - vlm: the module's fixture, used here too

# The char model's one answer, learned by heart: Markdown (bold, inline code, a code block) and a script element
ANSWER = "Hi! I am **tiny**: `x = 1`.\n```\nprint(1)\n```\n- <script>document.title='x'</script>\n"
DIALOGUE = "USER: hi\nASSISTANT: " + ANSWER
TEMPLATE = "{% for m in messages %}{{ m['role'] | upper }}: {{ m['content'] }}\n{% endfor %}" \
           "{% if add_generation_prompt %}ASSISTANT: {% endif %}"
ARTIFACTS = Path(os.environ.get("JAXLM_TEST_ARTIFACTS") or Path(__file__).resolve().parents[1] / "outputs") / "browser"
WAIT_S = 60


def missing() -> str | None:
    """Why the browser test cannot run here, in one line; None when it can."""
    absent = [p for p in ("chromium", "chromedriver", "socat") if shutil.which(p) is None]
    if absent:
        return (f"{', '.join(absent)} not found: `make browser` (part of `make test`) installs Debian's chromium, "
                "chromium-driver and socat as root")
    return None


@pytest.fixture(scope="module")
def browser():
    from selenium.webdriver.chrome.service import Service

    if (why := missing()) is not None:
        pytest.fail(why, pytrace=False)
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=960,760",
                "--force-prefers-reduced-motion", "--lang=en-US"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"performance": "ALL", "browser": "ALL"})
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)
    driver.set_page_load_timeout(WAIT_S)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def memorized(tmp_path_factory):
    """A char model that answers "hi" with ANSWER: 80 steps on the dialogue repeated (loss about 0.1)."""
    from conftest import tiny_config
    from jaxlm.data import prepare
    from jaxlm.train import loop as train

    tmp = tmp_path_factory.mktemp("memorized")
    (tmp / "corpus.txt").write_text(DIALOGUE * 300)
    prepare.prepare_text([tmp / "corpus.txt"], tmp / "data", vocab="char")
    train.train(tiny_config(tmp / "data", tmp / "run", **{
        "training.steps": 80, "model.block_size": 128, "optimizer.lr": 1e-2, "training.eval_interval": 80,
        "training.eval_batches": 1, "checkpoint.interval": 80}), log=lambda s: None)
    (tmp / "chat.jinja").write_text(TEMPLATE)
    return tmp


@pytest.fixture(scope="module")
def text_server(memorized):
    """The char model's server, with `slow`: set, each engine turn takes 0.2 s longer (an answer to stop midway)."""
    cfg = serve.settings_config({"serve.max_slots": 2, "serve.chat_template": str(memorized / "chat.jinja"),
                                 "serve.model_name": "tiny", "stop_at_eos": False})
    served = serve.build(memorized / "run", cfg, log=lambda s: None)
    slow = threading.Event()
    served.engine.turn_hooks.append(lambda: slow.is_set() and time.sleep(0.2))
    srv = serve.Server(served).start()
    srv.slow = slow
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def vlm_server(vlm):
    """The random Gemma 3 VLM of tests/test_serve_vision.py (its images 0.png, 1.png), with the API key "k1": the
    settings of that module's `paged` server, whose compiled programs the session's compilation cache then holds."""
    srv = start(vlm, **{"serve.page_size": 4, "serve.max_image_pixels": 5000, "serve.api_key": "k1"})
    srv.folder = vlm
    yield srv
    srv.stop()


def url(srv) -> str:
    return f"http://127.0.0.1:{srv.port}/"


def wait(condition, what: str, timeout: float = WAIT_S):
    """condition()'s first truthy value, polled every 20 ms."""
    deadline = time.monotonic() + timeout
    while not (got := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)
    return got


def find(driver, css: str):
    return driver.find_elements("css selector", css)


def texts(driver, css: str) -> list[str]:
    """The text each element matching `css` shows, read at one moment (the page renders an answer anew as it
    streams: an element found before may be gone)."""
    return driver.execute_script("return [...document.querySelectorAll(arguments[0])].map((e) => e.innerText)", css)


def text(driver, css: str) -> str | None:
    return next(iter(texts(driver, css)), None)


def open_page(driver, address: str, model: str | None):
    driver.get(address)
    if model is not None:
        wait(lambda: text(driver, "#model") == model, f"the page to show the model {model}")


def set_field(driver, field: str, value) -> None:
    if not find(driver, "#settings[open]"):
        driver.find_element("css selector", "#settings summary").click()
    box = driver.find_element("id", field)
    box.clear()
    box.send_keys(str(value))


def say(driver, message: str) -> None:
    box = driver.find_element("id", "input")
    box.send_keys(message)
    box.send_keys("\n")


def answered(driver) -> str | None:
    """The last answer's text once it ends (its stats line shows), else None."""
    return driver.execute_script("""
        const node = [...document.querySelectorAll(".msg.assistant")].at(-1);
        return node?.querySelector(".stats") ? node.querySelector(".body").innerText : null""")


def stored(driver) -> dict | None:
    """The conversation the page keeps in local storage; None before it keeps one."""
    return json.loads(driver.execute_script("return localStorage.getItem('jaxlm.chat')") or "null")


def sent_chats(driver) -> list[dict]:
    """The bodies of the /v1/chat/completions requests the page sent since this was last called."""
    out = []
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        request = message.get("params", {}).get("request", {})
        if message["method"] == "Network.requestWillBeSent" and request.get("url", "").endswith("/chat/completions"):
            out.append(json.loads(request.get("postData") or "".join(
                base64.b64decode(e["bytes"]).decode() for e in request["postDataEntries"])))
    return out


def api_answer(srv, body: dict, key: str = "none") -> str:
    """The server's plain (not streamed) answer to a chat request the page sent."""
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{srv.port}/v1", api_key=key, max_retries=0, timeout=120)
    plain = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    return c.chat.completions.create(**plain).choices[0].message.content


def busy_slots(srv) -> float:
    metrics = httpx.get(f"http://127.0.0.1:{srv.port}/metrics").text
    return float(re.search(r"^jaxlm_busy_slots (\S+)$", metrics, re.M).group(1))


def screenshot(driver, name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / name
    assert driver.save_screenshot(str(path)), path
    return path


def test_a_streamed_answer_equals_the_apis_and_renders_its_script_as_text(browser, text_server):
    """The page streams the answer (partial text shows before the end), which equals the API's greedy answer to the
    request the page sent; the model's Markdown renders (bold, code), its <script> as text; the stats line shows
    tokens/s and time to first token; a reload keeps the conversation, New conversation clears it."""
    open_page(browser, url(text_server), "tiny")
    assert text(browser, "#context") == "context 128 tokens"
    browser.execute_script("localStorage.clear()")
    browser.refresh()
    wait(lambda: text(browser, "#model") == "tiny", "the model's name")
    sent_chats(browser)
    set_field(browser, "temperature", 0)
    set_field(browser, "max_tokens", len(ANSWER))
    text_server.slow.set()  # 0.2 s a turn of 8 tokens: the answer streams over 2-3 s
    try:
        say(browser, "hi")
        partial = wait(lambda: (t := text(browser, ".msg.assistant .body")) and t, "the answer's first tokens")
        assert not answered(browser), "the answer showed all at once"
    finally:
        text_server.slow.clear()
    shown = wait(lambda: answered(browser), "the answer's end")
    [body] = sent_chats(browser)
    assert body == {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True,
                    "stream_options": {"include_usage": True}, "temperature": 0, "max_tokens": len(ANSWER)}
    want = api_answer(text_server, body)
    assert want == ANSWER  # learned by heart, so the checks below see its script element
    assert stored(browser)["messages"][1]["content"] == want
    assert partial != shown and "<script>document.title='x'</script>" in shown
    assert not find(browser, "#messages script") and browser.title == "jaxlm chat"
    assert texts(browser, ".assistant strong") == ["tiny"]
    assert texts(browser, ".assistant p code") == ["x = 1"]
    assert texts(browser, ".assistant pre code") == ["print(1)"]
    stats = text(browser, ".msg.assistant .stats")
    assert re.fullmatch(rf"{len(ANSWER)} tokens · [\d.]+ tokens/s · first token in \d+ ms", stats), stats
    screenshot(browser, "chat-text.png")

    browser.refresh()
    wait(lambda: answered(browser), "the conversation after a reload")
    assert texts(browser, ".msg .body") == ["hi", shown]
    browser.find_element("id", "new").click()
    assert not find(browser, ".msg")
    browser.refresh()
    wait(lambda: text(browser, "#model") == "tiny", "the model's name")
    assert not find(browser, ".msg") and stored(browser)["messages"] == []
    assert not [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]


def test_stop_ends_the_answer_and_frees_its_slot(browser, text_server):
    """Stop while the answer streams aborts the request: the server cancels the sequence (no busy slot in /metrics
    within a second), the page keeps what came, marked stopped, and takes the next message."""
    open_page(browser, url(text_server), "tiny")
    browser.find_element("id", "new").click()
    set_field(browser, "max_tokens", len(ANSWER))
    text_server.slow.set()
    try:
        say(browser, "hi")
        wait(lambda: len(text(browser, ".msg.assistant .body")) >= 5, "the answer's first tokens")
        assert busy_slots(text_server) == 1
        browser.find_element("id", "stop").click()
        stopped_at = time.monotonic()
        wait(lambda: busy_slots(text_server) == 0, "the slot to be freed", timeout=5)
        freed_s = time.monotonic() - stopped_at
    finally:
        text_server.slow.clear()
    assert wait(lambda: answered(browser), "the stopped answer")
    assert freed_s < 1.0, freed_s
    assert text(browser, ".msg.assistant .stats").startswith("stopped")
    got = stored(browser)["messages"][1]
    assert got["stopped"] and 0 < len(got["content"]) < len(ANSWER) and ANSWER.startswith(got["content"])
    assert browser.find_element("id", "send").is_displayed() and not browser.find_element("id", "stop").is_displayed()
    screenshot(browser, "chat-stopped.png")


def test_an_error_event_mid_stream_shows_its_line(browser, text_server, monkeypatch):
    """The decode program fails (an injected fault) while an answer streams: the stream's error event shows in the
    error line, the answer keeps what came, marked failed, and the next message is answered as before."""
    from jaxlm.serve import programs

    real, fail = programs.paged_decode_loop, threading.Event()

    def failing(*args, **kw):
        if fail.is_set():
            fail.clear()
            raise RuntimeError("injected fault")
        return real(*args, **kw)

    monkeypatch.setattr(programs, "paged_decode_loop", failing)
    open_page(browser, url(text_server), "tiny")
    browser.find_element("id", "new").click()
    set_field(browser, "max_tokens", len(ANSWER))
    text_server.slow.set()
    try:
        say(browser, "hi")
        wait(lambda: text(browser, ".msg.assistant .body"), "the answer's first tokens")
        fail.set()
        line = wait(lambda: text(browser, "#error"), "the error line")
    finally:
        text_server.slow.clear()
    assert line.startswith("the answer stopped with an error: generation failed: "), line
    assert text(browser, ".msg.assistant .stats") == "failed"
    say(browser, "hi")
    wait(lambda: len(texts(browser, ".msg.assistant .stats")) == 2, "the next answer")
    assert stored(browser)["messages"][-1]["content"] == ANSWER and not text(browser, "#error")


def test_an_image_for_a_text_model_and_a_bad_request_show_one_line(browser, text_server, tmp_path):
    """An image picked for a text model is refused on the page with the server's reason; a message the server
    answers 400 (a character outside the char model's vocabulary) shows the server's message, and goes back to the
    message box to be fixed."""
    open_page(browser, url(text_server), "tiny")
    browser.find_element("id", "new").click()
    (tmp_path / "red.png").write_bytes(png((255, 0, 0)))
    browser.find_element("id", "file").send_keys(str(tmp_path / "red.png"))
    line = wait(lambda: text(browser, "#error"), "the error line")
    assert line == "Images cannot be sent: this model has no vision tower"
    assert not find(browser, "#images img")
    say(browser, "hi Zed")
    line = wait(lambda: (t := text(browser, "#error")).startswith("Error 400") and t, "the 400 line")
    assert re.fullmatch(r"Error 400: the prompt cannot be tokenized: .*'Z'.*", line), line
    assert not find(browser, ".msg") and browser.find_element("id", "input").get_attribute("value") == "hi Zed"
    screenshot(browser, "chat-error.png")


def test_a_vision_model_behind_a_key_answers_an_image(browser, vlm_server):
    """The page of a server with an API key asks for it: a wrong one shows the 401 line; with the right one, an
    image picked and one pasted (then removed) go with the text, and the answer equals the API's."""
    open_page(browser, url(vlm_server), None)
    wait(lambda: browser.find_element("id", "keybar").is_displayed(), "the API key's prompt")
    for key in ("wrong", "k1"):
        browser.find_element("id", "key").send_keys(key + "\n")
        if key == "wrong":
            line = wait(lambda: text(browser, "#error"), "the error line")
            assert line == "Error 401: missing or wrong API key: send the header Authorization: Bearer KEY"
            screenshot(browser, "chat-key.png")
    wait(lambda: text(browser, "#model") == "jx", "the model's name")
    assert not browser.find_element("id", "keybar").is_displayed() and not text(browser, "#error")
    assert browser.execute_script("return sessionStorage.getItem('jaxlm.key')") == "k1"
    assert "k1" not in json.dumps(stored(browser) or {})
    sent_chats(browser)

    browser.find_element("id", "file").send_keys(str(vlm_server.folder / "0.png"))
    wait(lambda: len(find(browser, "#images img")) == 1, "the picked image's thumbnail")
    pasted = base64.b64encode((vlm_server.folder / "1.png").read_bytes()).decode()
    browser.execute_script("""
        const bytes = Uint8Array.from(atob(arguments[0]), (c) => c.charCodeAt(0));
        const data = new DataTransfer();
        data.items.add(new File([bytes], "pasted.png", {type: "image/png"}));
        const paste = new ClipboardEvent("paste", {clipboardData: data, bubbles: true});
        document.getElementById("input").dispatchEvent(paste);
    """, pasted)
    wait(lambda: len(find(browser, "#images img")) == 2, "the pasted image's thumbnail")
    find(browser, "#images img")[1].click()  # removed again
    assert len(find(browser, "#images img")) == 1
    say(browser, "w5 w6")
    assert wait(lambda: answered(browser), "the answer")
    [body] = sent_chats(browser)
    picture = "data:image/png;base64," + base64.b64encode((vlm_server.folder / "0.png").read_bytes()).decode()
    assert body["messages"] == [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": picture}},
                                                              {"type": "text", "text": "w5 w6"}]}]
    want = api_answer(vlm_server, body, key="k1")
    assert stored(browser)["messages"][-1]["content"] == want
    assert len(find(browser, ".msg.user img")) == 1
    screenshot(browser, "chat-image.png")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_the_page_over_a_unix_socket_through_the_printed_proxy_line(browser, text_server, tmp_path):
    """On serve.uds, `jaxlm serve` prints a socat line that forwards a TCP port to the socket: run as printed, the
    page it names answers through it."""
    sock = tmp_path / "jaxlm.sock"
    sc = serve.settings_config({"serve.uds": str(sock), "serve.port": free_port()}).serve
    line = chat_page.address_line(sc)
    command, address = re.search(r"`(socat [^`]+)`", line).group(1), re.search(r"http://\S+/$", line).group(0)
    uds = serve.Server(text_server.served, uds=str(sock)).start()
    proxy = subprocess.Popen(command.split(), stderr=subprocess.PIPE, text=True)
    try:
        wait(lambda: proxy.poll() is not None or listening(sc.port), "socat to listen")
        assert proxy.poll() is None, proxy.stderr.read()
        open_page(browser, address, "tiny")
        set_field(browser, "temperature", 0)
        set_field(browser, "max_tokens", 12)
        say(browser, "hi")
        assert wait(lambda: answered(browser), "the answer through the socket")
        assert stored(browser)["messages"][-1]["content"] == ANSWER[:12]
        assert text(browser, ".msg.assistant .stats").startswith("12 tokens")
    finally:
        proxy.terminate()
        proxy.wait(timeout=10)
        uds.stop(engine=False)


def test_the_page_headers_same_origin_calls_and_serve_ui_false(text_server):
    """The page and its files answer without the API key and with the security headers; the page's own calls
    (Origin = its address) are answered, a page elsewhere that rebinds its name to a server answering any Host is
    not; serve.ui=false serves no page (and prints no line about it)."""
    import dataclasses

    s = text_server.served
    base = url(text_server)
    s.api_key = "k2"
    try:
        for path, kind in (("", "text/html"), ("chat.js", "text/javascript"), ("chat.css", "text/css")):
            r = httpx.get(base + path)
            assert r.status_code == 200 and r.headers["content-type"].startswith(kind), (path, r.status_code)
            assert r.headers["x-content-type-options"] == "nosniff" and r.headers["x-frame-options"] == "DENY"
            csp = r.headers["content-security-policy"]
            assert "script-src 'self';" in csp and "frame-ancestors 'none'" in csp and "unsafe-inline" not in csp
        assert httpx.get(base + "v1/models").status_code == 401
    finally:
        s.api_key = None
    assert re.search(r"<script src=\"chat.js\" defer></script>", httpx.get(base).text)
    assert "<script>" not in httpx.get(base).text.replace('<script src="chat.js" defer></script>', "")

    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    port = text_server.port
    for host, origin, allowed_hosts, want in (
            (f"127.0.0.1:{port}", f"http://127.0.0.1:{port}", s.allowed_hosts, 200),
            (f"localhost:{port}", f"http://localhost:{port}", None, 200),  # serve.uds behind a local proxy
            (f"127.0.0.1:{port}", "http://evil.example", s.allowed_hosts, 403),
            (f"evil.example:{port}", f"http://evil.example:{port}", None, 403),  # rebound to a server taking any Host
            (f"evil.example:{port}", f"http://evil.example:{port}", frozenset({"evil.example"}), 200)):
        kept, s.allowed_hosts = s.allowed_hosts, allowed_hosts
        try:
            r = httpx.post(base + "v1/chat/completions", json=body, headers={"host": host, "origin": origin})
        finally:
            s.allowed_hosts = kept
        assert r.status_code == want, (host, origin, r.text)

    off = serve.Server(dataclasses.replace(s, ui=False)).start()
    try:
        assert httpx.get(f"http://127.0.0.1:{off.port}/").status_code == 404
        r = httpx.post(f"http://127.0.0.1:{off.port}/v1/chat/completions", json=body,
                       headers={"origin": f"http://127.0.0.1:{off.port}"})
        assert r.status_code == 403
    finally:
        off.stop(engine=False)
        s.engine.turn_hooks.remove(s.mailbox.flush)  # the copy's (the same mailbox's)
    assert chat_page.address_line(serve.settings_config({"serve.ui": False}).serve) is None
    assert chat_page.address_line(serve.settings_config({"serve.host": "0.0.0.0", "serve.port": 9000}).serve) == \
        "chat page: http://127.0.0.1:9000/"
