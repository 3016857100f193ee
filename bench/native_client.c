/* A measuring stick, not part of eventpush: libcurl's multi interface driven from C (an epoll
   set of its own holding libcurl's sockets and a timerfd for libcurl's timer), so that Python
   only hands a request in (submit) and takes finished ones out (run). bench/native_ab.py
   builds it and compares it with eventpush.sinks.http, to size what a native driver of the
   HTTP client would save the push engine (docs/BENCHMARKS.md, issue 34). It leaves out what
   the real client does besides: the address policy at connect, TLS files, pinned routes,
   Retry-After and Location. Built against the system's libcurl (libcurl4-openssl-dev). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <curl/curl.h>
#include <sys/epoll.h>
#include <sys/timerfd.h>
#include <unistd.h>
#include <string.h>
#include <stdint.h>

#define BODY_CAP (64 * 1024)

typedef struct Xfer {
    CURL *easy;
    struct curl_slist *headers;
    PyObject *body;
    PyObject *token;
    long seen, status, size;
    struct Xfer *next;
} Xfer;

typedef struct {
    PyObject_HEAD
    CURLM *multi;
    int epfd, tfd;
    Xfer *idle;
    long due;        /* what libcurl last asked for (-1 none) */
    long armed;      /* what the timerfd holds (-2 unknown) */
    unsigned char wanted[65536];
} Multi;

static void arm(Multi *m) {
    if (m->due == m->armed && m->due != 0) return;
    if (m->due == 0 && m->armed == 0) return; /* already due at once */
    struct itimerspec its;
    memset(&its, 0, sizeof its);
    if (m->due > 0) {
        its.it_value.tv_sec = m->due / 1000;
        its.it_value.tv_nsec = (m->due % 1000) * 1000000L;
    } else if (m->due == 0) {
        its.it_value.tv_nsec = 1;
    }
    timerfd_settime(m->tfd, 0, &its, NULL);
    m->armed = m->due;
}

static int sock_cb(CURL *e, curl_socket_t s, int what, void *userp, void *socketp) {
    Multi *m = (Multi *)userp;
    if (what == CURL_POLL_REMOVE) { /* stays in the set while idle */
        if (s < 65536) m->wanted[s] = 0;
        return 0;
    }
    struct epoll_event ev;
    memset(&ev, 0, sizeof ev);
    ev.data.fd = s;
    ev.events = ((what & CURL_POLL_IN) ? EPOLLIN : 0) | ((what & CURL_POLL_OUT) ? EPOLLOUT : 0);
    if (s < 65536) m->wanted[s] = (unsigned char)what;
    if (epoll_ctl(m->epfd, EPOLL_CTL_MOD, s, &ev) != 0)
        epoll_ctl(m->epfd, EPOLL_CTL_ADD, s, &ev);
    return 0;
}

static int timer_cb(CURLM *multi, long ms, void *userp) {
    ((Multi *)userp)->due = ms;
    return 0;
}

static size_t header_cb(char *buf, size_t size, size_t n, void *userp) {
    Xfer *x = (Xfer *)userp;
    size_t len = size * n;
    if (len >= 12 && memcmp(buf, "HTTP/", 5) == 0) {
        char *sp = memchr(buf, ' ', len);
        x->seen = (sp && sp + 4 <= buf + len) ? strtol(sp + 1, NULL, 10) : 0;
    } else if ((len == 2 && buf[0] == '\r' && buf[1] == '\n') || (len == 1 && buf[0] == '\n')) {
        if (x->seen >= 200) x->status = x->seen;
    }
    return len;
}

static size_t write_cb(char *buf, size_t size, size_t n, void *userp) {
    Xfer *x = (Xfer *)userp;
    x->size += size * n;
    return x->size > BODY_CAP ? 0 : size * n;
}

static int Multi_init(Multi *self, PyObject *args, PyObject *kw) {
    self->multi = curl_multi_init();
    self->epfd = epoll_create1(EPOLL_CLOEXEC);
    self->tfd = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC);
    struct epoll_event ev;
    memset(&ev, 0, sizeof ev);
    ev.events = EPOLLIN;
    ev.data.fd = self->tfd;
    epoll_ctl(self->epfd, EPOLL_CTL_ADD, self->tfd, &ev);
    curl_multi_setopt(self->multi, CURLMOPT_SOCKETFUNCTION, sock_cb);
    curl_multi_setopt(self->multi, CURLMOPT_SOCKETDATA, self);
    curl_multi_setopt(self->multi, CURLMOPT_TIMERFUNCTION, timer_cb);
    curl_multi_setopt(self->multi, CURLMOPT_TIMERDATA, self);
    self->idle = NULL;
    self->due = -1;
    self->armed = -2;
    memset(self->wanted, 0, sizeof self->wanted);
    return 0;
}

static PyObject *Multi_fileno(Multi *self, PyObject *unused) { return PyLong_FromLong(self->epfd); }

static PyObject *Multi_submit(Multi *self, PyObject *args) {
    PyObject *url, *body, *headers, *token;
    long timeout_ms;
    if (!PyArg_ParseTuple(args, "SSO!lO", &url, &body, &PyList_Type, &headers, &timeout_ms, &token))
        return NULL;
    if (self->multi == NULL) {
        PyErr_SetString(PyExc_ValueError, "closed");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(headers);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!PyBytes_Check(PyList_GET_ITEM(headers, i))) {
            PyErr_SetString(PyExc_TypeError, "header lines must be bytes");
            return NULL;
        }
    }
    Xfer *x = self->idle;
    if (x) {
        self->idle = x->next;
    } else {
        x = calloc(1, sizeof *x);
        x->easy = curl_easy_init();
        curl_easy_setopt(x->easy, CURLOPT_NOSIGNAL, 1L);
        curl_easy_setopt(x->easy, CURLOPT_PROXY, "");
        curl_easy_setopt(x->easy, CURLOPT_HEADERFUNCTION, header_cb);
        curl_easy_setopt(x->easy, CURLOPT_HEADERDATA, x);
        curl_easy_setopt(x->easy, CURLOPT_WRITEFUNCTION, write_cb);
        curl_easy_setopt(x->easy, CURLOPT_WRITEDATA, x);
        curl_easy_setopt(x->easy, CURLOPT_PRIVATE, x);
    }
    x->seen = x->status = x->size = 0;
    Py_INCREF(body);
    Py_INCREF(token);
    x->body = body;
    x->token = token;
    curl_easy_setopt(x->easy, CURLOPT_URL, PyBytes_AS_STRING(url));
    curl_easy_setopt(x->easy, CURLOPT_POSTFIELDSIZE, (long)PyBytes_GET_SIZE(body));
    curl_easy_setopt(x->easy, CURLOPT_POSTFIELDS, PyBytes_AS_STRING(body));
    if (x->headers) curl_slist_free_all(x->headers);
    x->headers = NULL;
    for (Py_ssize_t i = 0; i < n; i++)
        x->headers = curl_slist_append(x->headers, PyBytes_AS_STRING(PyList_GET_ITEM(headers, i)));
    curl_easy_setopt(x->easy, CURLOPT_HTTPHEADER, x->headers);
    curl_easy_setopt(x->easy, CURLOPT_TIMEOUT_MS, timeout_ms);
    curl_multi_add_handle(self->multi, x->easy);
    arm(self);
    Py_RETURN_NONE;
}

static PyObject *Multi_run(Multi *self, PyObject *unused) {
    if (self->multi == NULL) return PyList_New(0);
    struct epoll_event evs[128];
    int running = 0;
    int n = epoll_wait(self->epfd, evs, 128, 0);
    for (int i = 0; i < n; i++) {
        int fd = evs[i].data.fd;
        if (fd == self->tfd) {
            uint64_t t;
            if (read(self->tfd, &t, sizeof t) < 0) { /* not due after all */ }
            self->armed = -1;
            curl_multi_socket_action(self->multi, CURL_SOCKET_TIMEOUT, 0, &running);
        } else if (fd < 65536 && !self->wanted[fd]) {
            epoll_ctl(self->epfd, EPOLL_CTL_DEL, fd, NULL); /* an idle one stirred: closed */
        } else {
            int mask = 0;
            if (evs[i].events & (EPOLLIN | EPOLLHUP | EPOLLERR)) mask |= CURL_CSELECT_IN;
            if (evs[i].events & EPOLLOUT) mask |= CURL_CSELECT_OUT;
            if (evs[i].events & EPOLLERR) mask |= CURL_CSELECT_ERR;
            curl_multi_socket_action(self->multi, fd, mask, &running);
        }
    }
    PyObject *done = PyList_New(0);
    CURLMsg *msg;
    int left;
    while ((msg = curl_multi_info_read(self->multi, &left))) {
        if (msg->msg != CURLMSG_DONE) continue;
        Xfer *x;
        curl_easy_getinfo(msg->easy_handle, CURLINFO_PRIVATE, (char **)&x);
        CURLcode code = msg->data.result;
        curl_multi_remove_handle(self->multi, msg->easy_handle);
        PyObject *item = Py_BuildValue("(Nil)", x->token, (int)code, x->status);
        PyList_Append(done, item);
        Py_DECREF(item);
        Py_DECREF(x->body);
        x->body = x->token = NULL;
        x->next = self->idle;
        self->idle = x;
    }
    arm(self); /* once, for whatever libcurl asked while the sockets and answers were handled */
    return done;
}

/* Every transfer dropped (nobody waits for them once the loop is gone), every connection and
   descriptor closed. Only finished transfers' handles are kept, so the idle list is all. */
static PyObject *Multi_close(Multi *self, PyObject *unused) {
    if (self->multi == NULL) Py_RETURN_NONE;
    while (self->idle) {
        Xfer *x = self->idle;
        self->idle = x->next;
        curl_easy_cleanup(x->easy);
        curl_slist_free_all(x->headers);
        free(x);
    }
    curl_multi_cleanup(self->multi);
    self->multi = NULL;
    close(self->tfd);
    close(self->epfd);
    Py_RETURN_NONE;
}

static PyMethodDef Multi_methods[] = {
    {"close", (PyCFunction)Multi_close, METH_NOARGS, NULL},
    {"fileno", (PyCFunction)Multi_fileno, METH_NOARGS, NULL},
    {"submit", (PyCFunction)Multi_submit, METH_VARARGS, NULL},
    {"run", (PyCFunction)Multi_run, METH_NOARGS, NULL},
    {NULL}};

static PyTypeObject MultiType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "native_client.Multi",
    .tp_basicsize = sizeof(Multi),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Multi_init,
    .tp_methods = Multi_methods,
};

static struct PyModuleDef mod = {PyModuleDef_HEAD_INIT, "native_client", NULL, -1, NULL};

PyMODINIT_FUNC PyInit_native_client(void) {
    curl_global_init(CURL_GLOBAL_DEFAULT);
    if (PyType_Ready(&MultiType) < 0) return NULL;
    PyObject *m = PyModule_Create(&mod);
    Py_INCREF(&MultiType);
    PyModule_AddObject(m, "Multi", (PyObject *)&MultiType);
    return m;
}
