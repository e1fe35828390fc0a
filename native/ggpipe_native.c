/*
 * ggpipe._native: the few hooks a pipeline stage needs inside llama.cpp,
 * written in C so that no Python runs per graph node.
 *
 *  1. Hidden-state capture (partial-layer evaluation). llama.cpp calls the
 *     context's eval callback (`llama_context_params.cb_eval`, type
 *     ggml_backend_sched_eval_callback) for every graph node: first with
 *     ask=true ("do you want this node's data?"), then, for nodes answered
 *     yes, with ask=false once the node is computed. We answer yes only for
 *     the node named `target` (e.g. "l_out-11", the output of a slice's last
 *     layer), copy its float32 rows into a caller-owned buffer with
 *     ggml_backend_tensor_get, and return false so the rest of that graph
 *     split (output norm + LM head) is skipped.
 *
 *  2. Cancellation (PipeInfer IV.D.2). llama.cpp's CPU backend polls the
 *     abort callback (llama_set_abort_callback) between graph nodes; ours
 *     reads an int flag that any thread may set, so a stage can abandon a
 *     run mid-compute. llama_decode then returns 2.
 *
 *  3. KV sequence metadata. `fill_batch` writes token ids or embeddings,
 *     positions, the sequence ids of each token (a token of a speculation
 *     tree belongs to several sequences) and output flags into a
 *     `llama_batch` allocated by llama_batch_init, checking every length
 *     against the batch's capacity so a malformed request can never write
 *     out of bounds.
 *
 * No llama.cpp / ggml headers and no link-time dependency: the three ggml
 * functions we need are resolved at run time with dlsym from the
 * libggml-base shared library that llama-cpp-python already loaded.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

struct ggml_tensor; /* opaque */

typedef const char *(*ggml_get_name_fn)(const struct ggml_tensor *);
typedef size_t (*ggml_nbytes_fn)(const struct ggml_tensor *);
typedef void (*ggml_backend_tensor_get_fn)(const struct ggml_tensor *, void *, size_t, size_t);

static ggml_get_name_fn p_get_name = NULL;
static ggml_nbytes_fn p_nbytes = NULL;
static ggml_backend_tensor_get_fn p_tensor_get = NULL;

/* Mirrors `struct llama_batch` of llama.h (stable public layout). */
typedef struct {
    int32_t n_tokens;
    int32_t *token;
    float *embd;
    int32_t *pos;
    int32_t *n_seq_id;
    int32_t **seq_id;
    int8_t *logits;
} llama_batch_c;

#define TARGET_MAX 64

typedef struct {
    atomic_int cancel;        /* non-zero: abort the graph being computed */
    char target[TARGET_MAX];  /* node name to capture; "" captures nothing */
    int stop_after_capture;   /* return false after capturing */
    char *dst;                /* caller-owned buffer (kept alive by `owner`) */
    size_t capacity;          /* bytes */
    size_t captured;          /* bytes written so far (appends per ubatch) */
    int overflow;             /* a capture did not fit */
} hook_state;

typedef struct {
    PyObject_HEAD
    hook_state st;
    Py_buffer view;           /* the armed destination buffer */
    int has_view;
} HooksObject;

/* ---- callbacks called by llama.cpp / ggml (no GIL, any thread) ---------- */

static bool ggpipe_eval_cb(struct ggml_tensor *t, bool ask, void *user_data) {
    hook_state *st = (hook_state *)user_data;
    if (st->target[0] == '\0') {
        return ask ? false : true;
    }
    const char *name = p_get_name(t);
    if (name == NULL || strncmp(name, st->target, TARGET_MAX) != 0) {
        return ask ? false : true;
    }
    if (ask) {
        return true;
    }
    size_t n = p_nbytes(t);
    if (st->captured + n > st->capacity) {
        st->overflow = 1;
    } else {
        p_tensor_get(t, st->dst + st->captured, 0, n);
        st->captured += n;
    }
    return st->stop_after_capture ? false : true;
}

static bool ggpipe_abort_cb(void *data) {
    hook_state *st = (hook_state *)data;
    return atomic_load_explicit(&st->cancel, memory_order_relaxed) != 0;
}

/* ---- Hooks type ----------------------------------------------------------- */

static void hooks_release_view(HooksObject *self) {
    if (self->has_view) {
        PyBuffer_Release(&self->view);
        self->has_view = 0;
    }
    self->st.dst = NULL;
    self->st.capacity = 0;
}

static int Hooks_init(HooksObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "", kwlist)) {
        return -1;
    }
    memset(&self->st, 0, sizeof(self->st));
    atomic_store(&self->st.cancel, 0);
    self->has_view = 0;
    return 0;
}

static void Hooks_dealloc(HooksObject *self) {
    hooks_release_view(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

PyDoc_STRVAR(arm_doc,
"arm(target, buffer, stop=True)\n\n"
"Capture the float32 output of the graph node named `target` (e.g. 'l_out-11')\n"
"into `buffer` (a writable C-contiguous buffer, e.g. a float32 numpy array of\n"
"shape (n_tokens, n_embd)); successive ubatches append. With stop=True the\n"
"rest of the graph split is skipped after the capture. Raises ValueError for a\n"
"name longer than 63 bytes or a read-only buffer.");

static PyObject *Hooks_arm(HooksObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"target", "buffer", "stop", NULL};
    const char *target;
    Py_ssize_t target_len;
    PyObject *buf;
    int stop = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "s#O|p", kwlist, &target, &target_len, &buf, &stop)) {
        return NULL;
    }
    if (target_len >= TARGET_MAX) {
        PyErr_SetString(PyExc_ValueError, "capture target name too long");
        return NULL;
    }
    hooks_release_view(self);
    if (PyObject_GetBuffer(buf, &self->view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) != 0) {
        return NULL;
    }
    self->has_view = 1;
    memcpy(self->st.target, target, (size_t)target_len);
    self->st.target[target_len] = '\0';
    self->st.stop_after_capture = stop;
    self->st.dst = (char *)self->view.buf;
    self->st.capacity = (size_t)self->view.len;
    self->st.captured = 0;
    self->st.overflow = 0;
    Py_RETURN_NONE;
}

static PyObject *Hooks_disarm(HooksObject *self, PyObject *Py_UNUSED(ignored)) {
    self->st.target[0] = '\0';
    hooks_release_view(self);
    Py_RETURN_NONE;
}

static PyObject *Hooks_cancel(HooksObject *self, PyObject *Py_UNUSED(ignored)) {
    atomic_store(&self->st.cancel, 1);
    Py_RETURN_NONE;
}

static PyObject *Hooks_clear_cancel(HooksObject *self, PyObject *Py_UNUSED(ignored)) {
    atomic_store(&self->st.cancel, 0);
    Py_RETURN_NONE;
}

static PyObject *Hooks_get_cancelled(HooksObject *self, void *closure) {
    return PyBool_FromLong(atomic_load(&self->st.cancel) != 0);
}

static PyObject *Hooks_get_captured(HooksObject *self, void *closure) {
    return PyLong_FromSize_t(self->st.captured);
}

static PyObject *Hooks_get_overflow(HooksObject *self, void *closure) {
    return PyBool_FromLong(self->st.overflow);
}

static PyObject *Hooks_get_address(HooksObject *self, void *closure) {
    return PyLong_FromVoidPtr((void *)&self->st);
}

static PyMethodDef Hooks_methods[] = {
    {"arm", (PyCFunction)(void (*)(void))Hooks_arm, METH_VARARGS | METH_KEYWORDS, arm_doc},
    {"disarm", (PyCFunction)Hooks_disarm, METH_NOARGS, "Capture nothing; release the buffer."},
    {"cancel", (PyCFunction)Hooks_cancel, METH_NOARGS,
     "Set the cancellation flag: the graph being computed aborts at the next node (llama_decode returns 2). Thread-safe."},
    {"clear_cancel", (PyCFunction)Hooks_clear_cancel, METH_NOARGS, "Clear the cancellation flag."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Hooks_getset[] = {
    {"cancelled", (getter)Hooks_get_cancelled, NULL, "True while the cancellation flag is set.", NULL},
    {"captured_bytes", (getter)Hooks_get_captured, NULL, "Bytes captured since arm().", NULL},
    {"overflow", (getter)Hooks_get_overflow, NULL, "True if a capture did not fit the buffer (it was dropped).", NULL},
    {"address", (getter)Hooks_get_address, NULL,
     "Address of the C state: pass it as cb_eval_user_data and as the abort callback's data.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject HooksType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "ggpipe._native.Hooks",
    .tp_basicsize = sizeof(HooksObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Per-context capture target, destination buffer and cancellation flag.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Hooks_init,
    .tp_dealloc = (destructor)Hooks_dealloc,
    .tp_methods = Hooks_methods,
    .tp_getset = Hooks_getset,
};

/* ---- module functions ----------------------------------------------------- */

static PyObject *mod_init(PyObject *self, PyObject *args) {
    const char *path;
    if (!PyArg_ParseTuple(args, "s", &path)) {
        return NULL;
    }
    void *h = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
    if (h == NULL) {
        h = dlopen(path, RTLD_NOW | RTLD_GLOBAL);
    }
    if (h == NULL) {
        PyErr_Format(PyExc_OSError, "cannot open %s: %s", path, dlerror());
        return NULL;
    }
    p_get_name = (ggml_get_name_fn)dlsym(h, "ggml_get_name");
    p_nbytes = (ggml_nbytes_fn)dlsym(h, "ggml_nbytes");
    p_tensor_get = (ggml_backend_tensor_get_fn)dlsym(h, "ggml_backend_tensor_get");
    if (!p_get_name || !p_nbytes || !p_tensor_get) {
        PyErr_Format(PyExc_OSError, "%s lacks ggml_get_name / ggml_nbytes / ggml_backend_tensor_get", path);
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *mod_eval_cb(PyObject *self, PyObject *Py_UNUSED(ignored)) {
    if (p_get_name == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "ggpipe._native.init() was not called");
        return NULL;
    }
    return PyLong_FromVoidPtr((void *)&ggpipe_eval_cb);
}

static PyObject *mod_abort_cb(PyObject *self, PyObject *Py_UNUSED(ignored)) {
    return PyLong_FromVoidPtr((void *)&ggpipe_abort_cb);
}

/* Get a C-contiguous buffer of `itemsize`-byte items; returns item count or -1. */
static Py_ssize_t get_items(PyObject *obj, Py_buffer *view, Py_ssize_t itemsize, const char *what) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) != 0) {
        return -1;
    }
    if (view->itemsize != itemsize) {
        PyErr_Format(PyExc_ValueError, "%s: expected %zd-byte items, got %zd", what, itemsize, view->itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    return view->len / itemsize;
}

PyDoc_STRVAR(fill_batch_doc,
"fill_batch(batch_address, capacity, n_embd, n_seq_max, tokens, embd, pos, n_seq_id, seq_ids, logits) -> int\n\n"
"Fill a llama_batch made by llama_batch_init(capacity, n_embd or 0, n_seq_max).\n"
"n = len(pos) tokens. Exactly one of `tokens` (int32[n]) and `embd` (float32[n*n_embd])\n"
"is not None. n_seq_id: int32[n], each in 1..n_seq_max; seq_ids: int32[sum(n_seq_id)],\n"
"the sequence ids of token 0, then token 1, ...; each in 0..n_seq_max-1 (KV sequence\n"
"ids, not bounded by llama.cpp itself here). logits: int8[n] output flags.\n"
"Returns n. Raises ValueError on any length or range violation (nothing is written).");

static PyObject *mod_fill_batch(PyObject *self, PyObject *args) {
    unsigned long long addr;
    Py_ssize_t capacity, n_embd, n_seq_max;
    PyObject *o_tok, *o_embd, *o_pos, *o_nseq, *o_seq, *o_logits;
    if (!PyArg_ParseTuple(args, "KnnnOOOOOO", &addr, &capacity, &n_embd, &n_seq_max,
                          &o_tok, &o_embd, &o_pos, &o_nseq, &o_seq, &o_logits)) {
        return NULL;
    }
    if (addr == 0) {
        PyErr_SetString(PyExc_ValueError, "null batch");
        return NULL;
    }
    llama_batch_c *b = (llama_batch_c *)(uintptr_t)addr;
    Py_buffer v_tok = {0}, v_embd = {0}, v_pos = {0}, v_nseq = {0}, v_seq = {0}, v_log = {0};
    int h_tok = 0, h_embd = 0, h_pos = 0, h_nseq = 0, h_seq = 0, h_log = 0;
    PyObject *ret = NULL;
    Py_ssize_t n, m;

    if ((o_tok == Py_None) == (o_embd == Py_None)) {
        PyErr_SetString(PyExc_ValueError, "give exactly one of tokens and embd");
        goto done;
    }
    if ((n = get_items(o_pos, &v_pos, 4, "pos")) < 0) goto done;
    h_pos = 1;
    if (n < 1 || n > capacity) {
        PyErr_Format(PyExc_ValueError, "batch of %zd tokens, capacity %zd", n, capacity);
        goto done;
    }
    if (o_tok != Py_None) {
        if ((m = get_items(o_tok, &v_tok, 4, "tokens")) < 0) goto done;
        h_tok = 1;
        if (m != n || b->token == NULL) {
            PyErr_Format(PyExc_ValueError, "tokens: %zd items for %zd positions (or batch has no token array)", m, n);
            goto done;
        }
    } else {
        if ((m = get_items(o_embd, &v_embd, 4, "embd")) < 0) goto done;
        h_embd = 1;
        if (n_embd < 1 || m != n * n_embd || b->embd == NULL) {
            PyErr_Format(PyExc_ValueError, "embd: %zd floats for %zd x %zd (or batch has no embd array)", m, n, n_embd);
            goto done;
        }
    }
    if ((m = get_items(o_nseq, &v_nseq, 4, "n_seq_id")) < 0) goto done;
    h_nseq = 1;
    if (m != n) {
        PyErr_Format(PyExc_ValueError, "n_seq_id: %zd items for %zd tokens", m, n);
        goto done;
    }
    const int32_t *nseq = (const int32_t *)v_nseq.buf;
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (nseq[i] < 1 || nseq[i] > n_seq_max) {
            PyErr_Format(PyExc_ValueError, "token %zd belongs to %d sequences (1..%zd allowed)", i, nseq[i], n_seq_max);
            goto done;
        }
        total += nseq[i];
    }
    if ((m = get_items(o_seq, &v_seq, 4, "seq_ids")) < 0) goto done;
    h_seq = 1;
    if (m != total) {
        PyErr_Format(PyExc_ValueError, "seq_ids: %zd items, n_seq_id sums to %zd", m, total);
        goto done;
    }
    const int32_t *seq = (const int32_t *)v_seq.buf;
    for (Py_ssize_t k = 0; k < total; k++) {
        if (seq[k] < 0 || seq[k] >= n_seq_max) {
            PyErr_Format(PyExc_ValueError, "sequence id %d out of range 0..%zd", seq[k], n_seq_max - 1);
            goto done;
        }
    }
    if ((m = get_items(o_logits, &v_log, 1, "logits")) < 0) goto done;
    h_log = 1;
    if (m != n) {
        PyErr_Format(PyExc_ValueError, "logits: %zd flags for %zd tokens", m, n);
        goto done;
    }
    const int32_t *pos = (const int32_t *)v_pos.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (pos[i] < 0) {
            PyErr_Format(PyExc_ValueError, "negative position %d", pos[i]);
            goto done;
        }
    }

    /* all checked: write */
    if (h_tok) memcpy(b->token, v_tok.buf, (size_t)n * 4);
    if (h_embd) memcpy(b->embd, v_embd.buf, (size_t)(n * n_embd) * 4);
    memcpy(b->pos, pos, (size_t)n * 4);
    memcpy(b->logits, v_log.buf, (size_t)n);
    Py_ssize_t k = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        b->n_seq_id[i] = nseq[i];
        for (int j = 0; j < nseq[i]; j++) {
            b->seq_id[i][j] = seq[k++];
        }
    }
    b->n_tokens = (int32_t)n;
    ret = PyLong_FromSsize_t(n);

done:
    if (h_tok) PyBuffer_Release(&v_tok);
    if (h_embd) PyBuffer_Release(&v_embd);
    if (h_pos) PyBuffer_Release(&v_pos);
    if (h_nseq) PyBuffer_Release(&v_nseq);
    if (h_seq) PyBuffer_Release(&v_seq);
    if (h_log) PyBuffer_Release(&v_log);
    return ret;
}

static PyMethodDef module_methods[] = {
    {"init", mod_init, METH_VARARGS,
     "init(libggml_base_path): resolve ggml_get_name, ggml_nbytes and ggml_backend_tensor_get. Raises OSError."},
    {"eval_callback_address", mod_eval_cb, METH_NOARGS,
     "Address of the C eval callback (llama_context_params.cb_eval); user data: Hooks.address."},
    {"abort_callback_address", mod_abort_cb, METH_NOARGS,
     "Address of the C abort callback (llama_set_abort_callback); data: Hooks.address."},
    {"fill_batch", mod_fill_batch, METH_VARARGS, fill_batch_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT, "ggpipe._native",
    "llama.cpp hooks for pipeline stages: hidden-state capture, cancellation flag, batch filling.",
    -1, module_methods,
};

PyMODINIT_FUNC PyInit__native(void) {
    if (PyType_Ready(&HooksType) < 0) {
        return NULL;
    }
    PyObject *m = PyModule_Create(&native_module);
    if (m == NULL) {
        return NULL;
    }
    Py_INCREF(&HooksType);
    if (PyModule_AddObject(m, "Hooks", (PyObject *)&HooksType) < 0) {
        Py_DECREF(&HooksType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
