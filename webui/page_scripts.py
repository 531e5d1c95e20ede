"""The scripts the studio page runs in the browser (Gradio `js=` events): the engine line's poller, the
prompts restored from the browser's storage, the range notes of the number boxes, the phone's scroll to the
run. Plain strings; webui/studio.py wires them."""
from __future__ import annotations

HEALTH_EVERY_MS = 1000    # the engine line's refresh (a small POST per open page)


# The engine line refreshes itself from the page: a timer-driven Gradio event would re-apply every
# component's loading status on each tick, which wipes the validation message under a control (Gradio
# 6 front end: only after the first run, so a refused Generate looked like it did nothing). A plain
# fetch of the `health` endpoint does not touch that state.
HEALTH_JS = """
() => {
  if (window.__studioHealth) return;
  const root = ((window.gradio_config && window.gradio_config.root) || '').replace(/\\/$/, '');
  const show = (markup, ok) => {
    const line = document.querySelector('#engine-health .engine-line');
    if (!line) return;
    if (line.innerHTML !== markup) line.innerHTML = markup;
    line.dataset.polled = ok ? 'ok' : 'failed';   // tests wait for this: the page's events are wired
  };
  const poll = async () => {
    try {
      const r = await fetch(root + '/gradio_api/run/health', {method: 'POST', credentials: 'same-origin',
        headers: {'Content-Type': 'application/json'}, body: '{"data": []}'});
      if (!r.ok) throw new Error(String(r.status));
      show((await r.json()).data[0].html, true);
    } catch (e) {
      show('Studio server <b>not reachable</b> (retrying)', false);
    }
  };
  document.addEventListener('click', async (ev) => {
    if (!ev.target.closest || !ev.target.closest('#engine-health .engine-reload')) return;
    ev.target.disabled = true;
    try {
      await fetch(root + '/gradio_api/run/reload', {method: 'POST', credentials: 'same-origin',
        headers: {'Content-Type': 'application/json'}, body: '{"data": []}'});
    } finally { poll(); }
  });
  window.__studioHealth = setInterval(poll, %d);
  poll();
}
""" % HEALTH_EVERY_MS


# The two prompts as this browser last had them (BrowserState `saved_prompts`), unless one is typed already.
RESTORE_PROMPTS_JS = """
(saved, t2i, ti2i) => {
  const ok = Array.isArray(saved) && saved.length === 2;
  return [t2i || (ok ? saved[0] : '') || '', ti2i || (ok ? saved[1] : '') || ''];
}
"""


# A number typed outside a slider's range: Gradio's slider quietly sets it to the nearest bound (steps 0
# ran as 1, guidance 99 as 30), before any validator sees it. The page says so on the field, naming the
# range, until a value inside it is typed. Capture phase: the typed value, before the slider rewrites it.
# The seed box is a number box, which keeps what was typed: once the value is entered (change), the page
# sets it to the bound the note names, as a slider does (it said "so 0 is used", kept -5, and Generate was
# then refused). Its own input event (not trusted: a script's) leaves the note in place.
RANGE_JS = """
() => {
  if (window.__studioRanges) return;
  window.__studioRanges = true;
  const FIELDS = {steps: 'Steps', guidance: 'Guidance', 'max-new-tokens': 'Max new tokens', seed: 'Seed'};
  const SET_BY_PAGE = {seed: true};
  const check = (ev) => {
    const box = ev.target;
    if (!ev.isTrusted || !box || box.type !== 'number' || !box.closest) return;
    const field = box.closest(Object.keys(FIELDS).map((id) => '#' + id).join(','));
    if (!field) return;
    let note = field.querySelector('.range-note');
    const lo = Number(box.min), hi = Number(box.max), raw = box.value.trim(), v = Number(raw);
    const out = raw !== '' && box.min !== '' && box.max !== '' && !(v >= lo && v <= hi);
    if (!out) { if (note) note.remove(); return; }
    if (!note) {
      note = document.createElement('div');
      note.className = 'range-note validation-error';
      note.setAttribute('role', 'alert');
      field.appendChild(note);
    }
    const used = Number.isFinite(v) ? (v < lo ? lo : hi) : lo;
    note.textContent = `${FIELDS[field.id]} must be from ${lo} to ${hi}: ${raw} is out of range, so ${used} is used.`;
    if (SET_BY_PAGE[field.id] && ev.type === 'change') {
      box.value = String(used);
      box.dispatchEvent(new Event('input', {bubbles: true}));
    }
  };
  document.addEventListener('input', check, true);
  document.addEventListener('change', check, true);
}
"""

# On Generate: a phone shows the run column (status, reasoning, canvas) rather than the prompt just typed.
SHOW_RUN_JS = """
() => {
  const run = document.querySelector('#col-run');
  if (run && window.innerWidth < 1000) run.scrollIntoView({behavior: 'smooth', block: 'start'});
}
"""
