/*
 * pybridge/py_options.c - the keyword arguments of dmem.Runtime(...) and
 * dmem.configure(...), generated from the C library's table of options
 * (DMEM_CONFIG_OPTIONS, include/dmem/config.h), and dmem._dmem._config_options()
 * that lists them for the Python side (dmem.dask's pass-through, the check
 * of the README's table).
 *
 * The table is public, like the status table: it names only dmem_config_t's
 * fields, public enum values and public defaults, so the code generated here
 * writes the public struct and calls only public functions (dmem_size_parse,
 * through pyd_size_arg). Each kind of option has one converter from a Python
 * object; an option is one row of the table, no code here.
 */
#include "pydmem.h"

#include <string.h>

/* A converted value, of whichever member the kind uses. */
typedef struct pyd_opt_value {
  size_t size;
  double f, f2;
  long i;
  const char *s;
} pyd_opt_value_t;

/* The names of a '|'-separated list of choices, quoted: "'a', 'b' or 'c'". */
static void pyd_choice_words(const char *choices, char *buf, size_t cap) {
  size_t named = 0, k = 0;
  for (const char *p = choices; *p;) {
    const char *bar = strchr(p, '|');
    size_t len = bar ? (size_t)(bar - p) : strlen(p);
    if (len) named++;
    p = bar ? bar + 1 : p + len;
  }
  buf[0] = '\0';
  for (const char *p = choices; *p && named;) {
    const char *bar = strchr(p, '|');
    size_t len = bar ? (size_t)(bar - p) : strlen(p);
    if (len) {
      k++;
      size_t used = strlen(buf);
      snprintf(buf + used, cap - used, "%s'%.*s'", k == 1 ? "" : k == named ? " or " : ", ",
               (int)len, p);
    }
    p = bar ? bar + 1 : p + len;
  }
}

/* The position of str o among the names of choices (case-sensitive, as
 * Python compares), or -1. */
static long pyd_choice_index(const char *choices, PyObject *o) {
  Py_ssize_t n;
  const char *s = PyUnicode_AsUTF8AndSize(o, &n);
  if (!s) {
    PyErr_Clear();
    return -1;
  }
  long i = 0;
  for (const char *p = choices;; i++) {
    const char *bar = strchr(p, '|');
    size_t len = bar ? (size_t)(bar - p) : strlen(p);
    if (len > 0 && len == (size_t)n && memcmp(p, s, len) == 0) return i;
    if (!bar) return -1;
    p = bar + 1;
  }
}

static int pyd_type_error(const char *kw, const char *what, PyObject *o) {
  PyErr_Format(PyExc_TypeError, "%s must be %s, not %.100s", kw, what, Py_TYPE(o)->tp_name);
  return -1;
}

/* ---- one converter per kind (the kinds: include/dmem/config.h) ---------------- */

static int pyd_kind_size(PyObject *o, const char *kw, double lo, double hi, const char *choices,
                         pyd_opt_value_t *v, PyObject *keep) {
  (void)hi, (void)choices, (void)keep;
  if (pyd_size_arg(o, kw, &v->size, NULL) < 0) return -1;
  if ((double)v->size < lo) {
    if (lo == 1) PyErr_Format(PyExc_ValueError, "%s must be positive", kw);
    else PyErr_Format(PyExc_ValueError, "%s must be at least %zu bytes, not %R", kw, (size_t)lo, o);
    return -1;
  }
  return 0;
}

static int pyd_kind_size_or_percent(PyObject *o, const char *kw, double lo, double hi,
                                    const char *choices, pyd_opt_value_t *v, PyObject *keep) {
  (void)lo, (void)hi, (void)choices, (void)keep;
  return pyd_size_arg(o, kw, &v->size, &v->f);
}

static int pyd_kind_fraction(PyObject *o, const char *kw, double lo, double hi,
                             const char *choices, pyd_opt_value_t *v, PyObject *keep) {
  (void)choices, (void)keep;
  if (!(PyFloat_Check(o) || PyLong_Check(o)) || PyBool_Check(o))
    return pyd_type_error(kw, "a float", o);
  double f = PyFloat_AsDouble(o);
  if (f == -1.0 && PyErr_Occurred()) return -1;
  if (!(f >= lo && f <= hi)) {
    char range[64]; /* PyErr_Format has no %g */
    snprintf(range, sizeof range, "[%g, %g]", lo, hi);
    PyErr_Format(PyExc_ValueError, "%s must be in %s, not %R", kw, range, o);
    return -1;
  }
  v->f = f;
  return 0;
}

static int pyd_kind_integer(PyObject *o, const char *kw, double lo, double hi,
                            const char *choices, pyd_opt_value_t *v, PyObject *keep) {
  (void)choices, (void)keep;
  if (!PyLong_Check(o) || PyBool_Check(o)) return pyd_type_error(kw, "an int", o);
  int ovf = 0;
  long x = PyLong_AsLongAndOverflow(o, &ovf);
  if (x == -1 && PyErr_Occurred()) return -1;
  if (ovf || x < (long)lo || x > (long)hi) {
    PyErr_Format(PyExc_ValueError, "%s must be an int in %ld..%ld, not %R", kw, (long)lo,
                 (long)hi, o);
    return -1;
  }
  v->i = x;
  return 0;
}

static int pyd_kind_choice(PyObject *o, const char *kw, double lo, double hi,
                           const char *choices, pyd_opt_value_t *v, PyObject *keep) {
  (void)lo, (void)hi, (void)keep;
  if (!PyUnicode_Check(o)) return pyd_type_error(kw, "a str", o);
  v->i = pyd_choice_index(choices, o);
  if (v->i < 0) {
    char words[256];
    pyd_choice_words(choices, words, sizeof words);
    PyErr_Format(PyExc_ValueError, "%s must be %s, not %R", kw, words, o);
    return -1;
  }
  return 0;
}

static int pyd_kind_log(PyObject *o, const char *kw, double lo, double hi, const char *choices,
                        pyd_opt_value_t *v, PyObject *keep) {
  (void)keep;
  if (PyUnicode_Check(o)) {
    v->i = pyd_choice_index(choices, o);
    if (v->i >= 0) return 0;
    if (PyUnicode_CompareWithASCIIString(o, "warning") == 0) {
      v->i = DMEM_LOG_WARN;
      return 0;
    }
  } else if (PyLong_Check(o) && !PyBool_Check(o)) {
    int ovf = 0;
    long x = PyLong_AsLongAndOverflow(o, &ovf);
    if (x == -1 && PyErr_Occurred()) return -1;
    if (!ovf && x >= (long)lo && x <= (long)hi) {
      v->i = x;
      return 0;
    }
  } else {
    return pyd_type_error(kw, "a str or an int", o);
  }
  char words[256];
  pyd_choice_words(choices, words, sizeof words);
  PyErr_Format(PyExc_ValueError, "%s must be %s, or %ld..%ld, not %R", kw, words, (long)lo,
               (long)hi, o);
  return -1;
}

static int pyd_kind_path(PyObject *o, const char *kw, double lo, double hi, const char *choices,
                         pyd_opt_value_t *v, PyObject *keep) {
  (void)kw, (void)lo, (void)hi, (void)choices;
  PyObject *bytes = NULL;
  if (!PyUnicode_FSConverter(o, &bytes)) return -1;
  int r = PyList_Append(keep, bytes); /* the text lives until the runtime is made */
  Py_DECREF(bytes);
  if (r < 0) return -1;
  v->s = PyBytes_AS_STRING(bytes);
  return 0;
}

/* Kinds with no Python form: a row of such a kind has no keyword. */
static int pyd_kind_none(PyObject *o, const char *kw) {
  (void)o;
  PyErr_Format(PyExc_TypeError, "%s has no Python keyword", kw);
  return -1;
}
static int pyd_kind_stats(PyObject *o, const char *kw, double lo, double hi, const char *choices,
                          pyd_opt_value_t *v, PyObject *keep) {
  (void)lo, (void)hi, (void)choices, (void)v, (void)keep;
  return pyd_kind_none(o, kw);
}
/* One mark of spill_ahead: a float in (0, 1], or "N%". */
static int pyd_ahead_mark(PyObject *o, const char *kw, double *out) {
  double f = 0.0;
  if (PyUnicode_Check(o)) {
    size_t bytes = 0;
    if (pyd_size_arg(o, kw, &bytes, &f) < 0) return -1;
    if (!(f > 0.0)) {
      PyErr_Format(PyExc_ValueError, "%s: %R is no percentage of the limit", kw, o);
      return -1;
    }
  } else if ((PyFloat_Check(o) || PyLong_Check(o)) && !PyBool_Check(o)) {
    f = PyFloat_AsDouble(o);
    if (f == -1.0 && PyErr_Occurred()) return -1;
  } else {
    return pyd_type_error(kw, "a float, a percentage or a pair of them", o);
  }
  if (!(f >= 0.0 && f <= 1.0)) {
    PyErr_Format(PyExc_ValueError, "%s: %R is not a fraction of the limit in [0, 1]", kw, o);
    return -1;
  }
  *out = f;
  return 0;
}

/* spill_ahead: False or "off" (off), True or "on" (0.95), a fraction of the
 * limit (0: off), "N%", a pair (high, low) with 0 < low < high, or "N%,M%";
 * the low mark 0: the default (high - 0.05). */
static int pyd_kind_ahead(PyObject *o, const char *kw, double lo, double hi, const char *choices,
                          pyd_opt_value_t *v, PyObject *keep) {
  (void)lo, (void)hi, (void)choices, (void)keep;
  v->f = v->f2 = 0.0;
  if (PyBool_Check(o)) {
    v->f = o == Py_True ? 0.95 : 0.0;
    return 0;
  }
  if (PyUnicode_Check(o)) {
    if (PyUnicode_CompareWithASCIIString(o, "off") == 0 ||
        PyUnicode_CompareWithASCIIString(o, "0") == 0)
      return 0;
    if (PyUnicode_CompareWithASCIIString(o, "on") == 0) {
      v->f = 0.95;
      return 0;
    }
    Py_ssize_t comma = PyUnicode_FindChar(o, ',', 0, PyUnicode_GET_LENGTH(o), 1);
    if (comma == -2) return -1;
    if (comma >= 0) {
      PyObject *sep = PyUnicode_FromOrdinal(',');
      if (!sep) return -1;
      PyObject *pair = PyUnicode_Split(o, sep, 1);
      Py_DECREF(sep);
      if (!pair) return -1;
      int rc = pyd_ahead_mark(PyList_GET_ITEM(pair, 0), kw, &v->f) < 0 ||
                       pyd_ahead_mark(PyList_GET_ITEM(pair, 1), kw, &v->f2) < 0
                   ? -1
                   : 0;
      Py_DECREF(pair);
      if (rc < 0) return -1;
    } else if (pyd_ahead_mark(o, kw, &v->f) < 0) {
      return -1;
    }
  } else if (PyTuple_Check(o) || PyList_Check(o)) {
    if (PySequence_Fast_GET_SIZE(o) != 2)
      return pyd_type_error(kw, "a float, a percentage or a pair of them", o);
    if (pyd_ahead_mark(PySequence_Fast_GET_ITEM(o, 0), kw, &v->f) < 0 ||
        pyd_ahead_mark(PySequence_Fast_GET_ITEM(o, 1), kw, &v->f2) < 0)
      return -1;
  } else if (pyd_ahead_mark(o, kw, &v->f) < 0) {
    return -1;
  }
  if (v->f2 > 0.0 && !(v->f2 < v->f)) {
    PyErr_Format(PyExc_ValueError, "%s: the low mark must be below the high mark, not %R", kw, o);
    return -1;
  }
  return 0;
}

/* Store a converted value into the field(s). */
#define PYD_STORE_size(cfg, field, also, v) ((cfg)->field = (v).size)
#define PYD_STORE_size_or_percent(cfg, field, also, v) \
  ((cfg)->field = (v).f > 0.0 ? 0 : (v).size, (cfg)->also = (v).f)
#define PYD_STORE_fraction(cfg, field, also, v) ((cfg)->field = (v).f)
#define PYD_STORE_integer(cfg, field, also, v) ((cfg)->field = (v).i)
#define PYD_STORE_choice(cfg, field, also, v) ((cfg)->field = (v).i)
#define PYD_STORE_log(cfg, field, also, v) ((cfg)->field = (v).i)
#define PYD_STORE_path(cfg, field, also, v) ((cfg)->field = (v).s)
#define PYD_STORE_stats(cfg, field, also, v) ((void)0)
#define PYD_STORE_ahead(cfg, field, also, v) ((cfg)->field = (v).f, (cfg)->also = (v).f2)

/* ---- the table's keywords --------------------------------------------------------- */

/* Every row of the table, keyword or not (NULL). */
#define PYD_ROW_KEYWORD(field, also, kind, def, env, kw, lo, hi, choices, doc) kw,
static const char *const pyd_opt_keywords[] = {DMEM_CONFIG_OPTIONS(PYD_ROW_KEYWORD)};
#undef PYD_ROW_KEYWORD
#define PYD_NOPTS (sizeof pyd_opt_keywords / sizeof pyd_opt_keywords[0])

const char *pyd_log_names[5] = {"off", "error", "warn", "info", "debug"};

int pyd_log_level_arg(PyObject *o) {
  pyd_opt_value_t v;
#define PYD_ROW_LOG(field, also, kind, def, env, kw, lo, hi, choices, doc)           \
  if (strcmp(#field, "log_level") == 0)                                             \
    return pyd_kind_##kind(o, "log_level", lo, hi, choices, &v, NULL) < 0 ? -1 : (int)v.i;
  DMEM_CONFIG_OPTIONS(PYD_ROW_LOG)
#undef PYD_ROW_LOG
  PyErr_SetString(PyExc_SystemError, "no log_level row in DMEM_CONFIG_OPTIONS");
  return -1;
}

int pyd_config_parse(PyObject *args, PyObject *kwds, const char *func, int keyword_only,
                     dmem_config_t *cfg, PyObject **keep, int *device_given) {
  PyObject *vals[PYD_NOPTS];
  size_t order[PYD_NOPTS]; /* the rows with keywords, in the order of positions */
  size_t nkw = 0;
  for (size_t i = 0; i < PYD_NOPTS; i++) {
    vals[i] = NULL;
    if (pyd_opt_keywords[i]) order[nkw++] = i;
  }
  *keep = NULL;
  if (device_given) *device_given = 0;
  Py_ssize_t npos = args ? PyTuple_GET_SIZE(args) : 0;
  if (npos > 0 && keyword_only) {
    PyErr_Format(PyExc_TypeError, "%s() takes no positional arguments", func);
    return -1;
  }
  if ((size_t)npos > nkw) {
    PyErr_Format(PyExc_TypeError, "%s() takes at most %zu arguments (%zd given)", func, nkw,
                 npos);
    return -1;
  }
  for (Py_ssize_t p = 0; p < npos; p++) vals[order[p]] = PyTuple_GET_ITEM(args, p);
  if (kwds) {
    PyObject *key, *value;
    Py_ssize_t pos = 0;
    while (PyDict_Next(kwds, &pos, &key, &value)) {
      if (!PyUnicode_Check(key)) {
        PyErr_Format(PyExc_TypeError, "%s() keywords must be strings", func);
        return -1;
      }
      size_t i = 0;
      while (i < PYD_NOPTS &&
             !(pyd_opt_keywords[i] && PyUnicode_CompareWithASCIIString(key, pyd_opt_keywords[i]) == 0))
        i++;
      if (i == PYD_NOPTS) {
        PyErr_Format(PyExc_TypeError, "%s() got an unexpected keyword argument '%U'", func, key);
        return -1;
      }
      if (vals[i]) {
        PyErr_Format(PyExc_TypeError, "argument for %s() given by name ('%s') and position",
                     func, pyd_opt_keywords[i]);
        return -1;
      }
      vals[i] = value;
    }
  }
  *keep = PyList_New(0);
  if (!*keep) return -1;
  size_t row = 0;
  /* None: the default, or the environment's value (dmem_config_init). */
#define PYD_ROW_PARSE(field, also, kind, def, env, kw, lo, hi, choices, doc)           \
  if (vals[row] && vals[row] != Py_None) {                                            \
    pyd_opt_value_t v = {0};                                                          \
    if (pyd_kind_##kind(vals[row], kw, lo, hi, choices, &v, *keep) < 0) goto fail;    \
    PYD_STORE_##kind(cfg, field, also, v);                                            \
    if (device_given && strcmp(#field, "device") == 0) *device_given = 1;             \
  }                                                                                   \
  row++;
  DMEM_CONFIG_OPTIONS(PYD_ROW_PARSE)
#undef PYD_ROW_PARSE
  return 0;
fail:
  Py_CLEAR(*keep);
  return -1;
}

PyObject *pyd_mod_config_options(PyObject *mod, PyObject *unused) {
  (void)mod, (void)unused;
  PyObject *list = PyList_New(0);
  if (!list) return NULL;
#define PYD_ROW_INFO(field, also, kind, def, env, kw, lo, hi, choices, doc)                 \
  {                                                                                        \
    const char *e_ = env, *k_ = kw, *c_ = choices;                                         \
    PyObject *d_ = Py_BuildValue("{s:s,s:s,s:z,s:z,s:z,s:s}", "field", #field, "kind", #kind, \
                                 "env", e_, "keyword", k_, "choices", c_, "doc", doc);      \
    if (!d_ || PyList_Append(list, d_) < 0) {                                              \
      Py_XDECREF(d_);                                                                      \
      Py_DECREF(list);                                                                     \
      return NULL;                                                                         \
    }                                                                                      \
    Py_DECREF(d_);                                                                         \
  }
  DMEM_CONFIG_OPTIONS(PYD_ROW_INFO)
#undef PYD_ROW_INFO
  return list;
}

const char *pyd_config_doc(const char *func, int keyword_only, const char *body) {
  size_t cap = strlen(func) + strlen(body) + 16;
  for (size_t i = 0; i < PYD_NOPTS; i++)
    if (pyd_opt_keywords[i]) cap += strlen(pyd_opt_keywords[i]) + 8 + strlen(func) + 2;
  char *s = PyMem_RawMalloc(cap); /* kept for the life of the process, as the type */
  if (!s) return NULL;
  size_t indent = strlen(func) + 1, col = indent, n = 0;
  n += (size_t)snprintf(s + n, cap - n, "%s(%s", func, keyword_only ? "*" : "");
  col += keyword_only ? 1 : 0;
  int first = !keyword_only;
  for (size_t i = 0; i < PYD_NOPTS; i++) {
    if (!pyd_opt_keywords[i]) continue;
    size_t w = strlen(pyd_opt_keywords[i]) + 5 + (first ? 0 : 2);
    if (!first && col + w > 88) { /* wrap under the first argument */
      n += (size_t)snprintf(s + n, cap - n, ",\n%*s", (int)indent, "");
      col = indent;
    } else if (!first) {
      n += (size_t)snprintf(s + n, cap - n, ", ");
      col += 2;
    }
    n += (size_t)snprintf(s + n, cap - n, "%s=None", pyd_opt_keywords[i]);
    col += strlen(pyd_opt_keywords[i]) + 5;
    first = 0;
  }
  snprintf(s + n, cap - n, ")\n\n%s", body);
  return s;
}
