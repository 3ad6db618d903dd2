/* A row-form predict body read straight into the packed endpoint's buffers, in one pass over its bytes.
 *
 * The body is TF Serving's row form: {"instances": [{"<input>": <value>, ...}, ...], "signature_name": "..."}.
 * Every input is a float column (a JSON number or null) or a string column (a JSON string or null). Numbers go
 * into a float32 matrix [rows, floats] (null or a missing key: NaN); strings are left where they are in the body
 * and their spans (offset, length) written to [rows, strings, 2] (null or a missing key: length 0).
 *
 * Strings with escapes are decoded into a buffer beside the body, where their spans point instead.
 *
 * It reads only what it can read exactly as the general path (msgspec, then the column converters) reads it,
 * and answers CTR_ROWS_NOT_HANDLED for anything else: an escape in a key, a lone surrogate or U+0000 in a
 * string, bytes that are not UTF-8, a
 * number outside float32, a boolean, an unknown or repeated key, another signature, any other shape, JSON that
 * is not well formed. The caller then takes the general path, which reads the request again and says what is
 * wrong with it. So this file never has to produce an error message, only to be right about what it accepts.
 *
 * Plain C with no Python headers: serving/native_rows.py compiles it with the host's C compiler and calls it
 * through ctypes (which releases the GIL for the call). Numbers are read with strtod, whose decimal point is the
 * C locale's in a Python process (Python leaves LC_NUMERIC alone).
 */
#include <float.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define CTR_ROWS_NOT_HANDLED (-1)
#define CTR_ROWS_TOO_MANY (-2)
#define MAX_NUMBER_CHARS 64

typedef struct {
    const uint8_t *at;
    const uint8_t *end;
} cursor;

static void skip_space(cursor *c) {
    while (c->at < c->end && (*c->at == ' ' || *c->at == '\n' || *c->at == '\r' || *c->at == '\t')) {
        c->at++;
    }
}

/* Consumes `byte` after any whitespace; 0 when the next byte is another. */
static int take(cursor *c, uint8_t byte) {
    skip_space(c);
    if (c->at < c->end && *c->at == byte) {
        c->at++;
        return 1;
    }
    return 0;
}

static int take_word(cursor *c, const char *word, size_t length) {
    if ((size_t)(c->end - c->at) >= length && memcmp(c->at, word, length) == 0) {
        c->at += length;
        return 1;
    }
    return 0;
}

/* The length of the well-formed UTF-8 sequence of two or more bytes at p (no overlong forms, no surrogates,
 * nothing above U+10FFFF), or 0. */
static int utf8_length(const uint8_t *p, const uint8_t *end) {
    uint8_t b = *p;
    if (b >= 0xC2 && b <= 0xDF) {
        return end - p >= 2 && (p[1] & 0xC0) == 0x80 ? 2 : 0;
    }
    if (b >= 0xE0 && b <= 0xEF) {
        if (end - p < 3 || (p[1] & 0xC0) != 0x80 || (p[2] & 0xC0) != 0x80) return 0;
        if (b == 0xE0 && p[1] < 0xA0) return 0;
        if (b == 0xED && p[1] > 0x9F) return 0;
        return 3;
    }
    if (b >= 0xF0 && b <= 0xF4) {
        if (end - p < 4 || (p[1] & 0xC0) != 0x80 || (p[2] & 0xC0) != 0x80 || (p[3] & 0xC0) != 0x80) return 0;
        if (b == 0xF0 && p[1] < 0x90) return 0;
        if (b == 0xF4 && p[1] > 0x8F) return 0;
        return 4;
    }
    return 0;
}

/* A JSON string with no escapes, of well-formed UTF-8 and no control characters; the cursor on its opening
 * quote. Sets its content's span; 0 for anything else (a string with an escape goes to read_escaped). */
static int read_string(cursor *c, const uint8_t **start, int64_t *length) {
    if (c->at >= c->end || *c->at != '"') {
        return 0;
    }
    const uint8_t *p = c->at + 1;
    const uint8_t *end = c->end;
    *start = p;
    while (p < end) {
        uint8_t b = *p;
        if (b == '"') {
            *length = p - *start;
            c->at = p + 1;
            return 1;
        }
        if (b == '\\' || b < 0x20) {
            return 0;
        }
        if (b < 0x80) {
            p++;
            continue;
        }
        int n = utf8_length(p, end);
        if (n == 0) return 0;
        p += n;
    }
    return 0;
}

/* Where strings with escapes are written decoded: `data` [capacity]; a span in it is told from a span in the
 * body by its offset, `base` (the body's length) or more. */
typedef struct {
    uint8_t *data;
    int64_t used;
    int64_t capacity;
    int64_t base;
} text_buffer;

static int32_t hex4(const uint8_t *p, const uint8_t *end) {
    if (end - p < 4) return -1;
    int32_t value = 0;
    for (int i = 0; i < 4; i++) {
        uint8_t h = p[i];
        int digit = h >= '0' && h <= '9' ? h - '0' : h >= 'a' && h <= 'f' ? h - 'a' + 10 :
                    h >= 'A' && h <= 'F' ? h - 'A' + 10 : -1;
        if (digit < 0) return -1;
        value = value * 16 + digit;
    }
    return value;
}

/* A JSON string with escapes, decoded into `text` as msgspec decodes it: the two-character escapes, \uXXXX and
 * surrogate pairs as UTF-8. 0 for a lone surrogate (msgspec refuses it), for U+0000 (a cell cannot hold a
 * trailing one), for bytes that are not UTF-8, a control character, or no closing quote. */
static int read_escaped(cursor *c, text_buffer *text, int64_t *offset, int64_t *length) {
    if (c->at >= c->end || *c->at != '"') return 0;
    const uint8_t *p = c->at + 1;
    const uint8_t *end = c->end;
    uint8_t *first = text->data + text->used;
    uint8_t *out = first;
    uint8_t *limit = text->data + text->capacity;
    while (p < end) {
        uint8_t b = *p;
        if (b == '"') {
            *offset = text->base + (first - text->data);
            *length = out - first;
            text->used = out - text->data;
            c->at = p + 1;
            return 1;
        }
        if (b < 0x20) return 0;
        if (b != '\\') {
            int n = b < 0x80 ? 1 : utf8_length(p, end);
            if (n == 0 || limit - out < n) return 0;
            memcpy(out, p, (size_t)n);
            out += n;
            p += n;
            continue;
        }
        if (end - p < 2) return 0;
        uint8_t single = 0;
        switch (p[1]) {
            case '"': single = '"'; break;
            case '\\': single = '\\'; break;
            case '/': single = '/'; break;
            case 'b': single = '\b'; break;
            case 'f': single = '\f'; break;
            case 'n': single = '\n'; break;
            case 'r': single = '\r'; break;
            case 't': single = '\t'; break;
            case 'u': break;
            default: return 0;
        }
        if (single) {
            if (out >= limit) return 0;
            *out++ = single;
            p += 2;
            continue;
        }
        int32_t unit = hex4(p + 2, end);
        if (unit < 0) return 0;
        p += 6;
        uint32_t code = (uint32_t)unit;
        if (unit >= 0xD800 && unit <= 0xDBFF) {
            if (end - p < 6 || p[0] != '\\' || p[1] != 'u') return 0;
            int32_t low = hex4(p + 2, end);
            if (low < 0xDC00 || low > 0xDFFF) return 0;
            code = 0x10000 + (((uint32_t)unit - 0xD800) << 10) + ((uint32_t)low - 0xDC00);
            p += 6;
        } else if (unit >= 0xDC00 && unit <= 0xDFFF) {
            return 0;
        }
        if (code == 0 || limit - out < 4) return 0;
        if (code < 0x80) {
            *out++ = (uint8_t)code;
        } else if (code < 0x800) {
            *out++ = (uint8_t)(0xC0 | (code >> 6));
            *out++ = (uint8_t)(0x80 | (code & 0x3F));
        } else if (code < 0x10000) {
            *out++ = (uint8_t)(0xE0 | (code >> 12));
            *out++ = (uint8_t)(0x80 | ((code >> 6) & 0x3F));
            *out++ = (uint8_t)(0x80 | (code & 0x3F));
        } else {
            *out++ = (uint8_t)(0xF0 | (code >> 18));
            *out++ = (uint8_t)(0x80 | ((code >> 12) & 0x3F));
            *out++ = (uint8_t)(0x80 | ((code >> 6) & 0x3F));
            *out++ = (uint8_t)(0x80 | (code & 0x3F));
        }
    }
    return 0;
}

/* Exact powers of ten in a double: 10^0 .. 10^22. */
static const double POWERS_OF_TEN[] = {1e0,  1e1,  1e2,  1e3,  1e4,  1e5,  1e6,  1e7,  1e8,  1e9,  1e10, 1e11,
                                       1e12, 1e13, 1e14, 1e15, 1e16, 1e17, 1e18, 1e19, 1e20, 1e21, 1e22};

/* A JSON number (RFC 8259's grammar, nothing looser) as a float32: its double value correctly rounded, then
 * rounded to float32 as numpy rounds a float64. 0 when it is not one or its magnitude is over float32's
 * largest (the general path names that value).
 *
 * The double: where the digits make an integer of at most 2^53 and the exponent is within 22, the integer
 * times or over an exact power of ten is one correctly rounded operation (Clinger's fast path); anything else
 * goes to strtod, which is correctly rounded and about ten times slower. */
static int read_number(cursor *c, float *out) {
    const uint8_t *p = c->at;
    const uint8_t *end = c->end;
    const uint8_t *start = p;
    int negative = 0, exact = 1;
    uint64_t mantissa = 0;
    int64_t exponent = 0; /* of ten, applied to `mantissa` */
    if (p < end && *p == '-') {
        negative = 1;
        p++;
    }
    if (p >= end) return 0;
    if (*p == '0') {
        p++;
    } else if (*p >= '1' && *p <= '9') {
        while (p < end && *p >= '0' && *p <= '9') {
            if (mantissa < (UINT64_C(1) << 53) / 10) {
                mantissa = mantissa * 10 + (uint64_t)(*p - '0');
            } else {
                exact = 0;
            }
            p++;
        }
    } else {
        return 0;
    }
    if (p < end && *p == '.') {
        p++;
        if (p >= end || *p < '0' || *p > '9') return 0;
        while (p < end && *p >= '0' && *p <= '9') {
            if (mantissa < (UINT64_C(1) << 53) / 10) {
                mantissa = mantissa * 10 + (uint64_t)(*p - '0');
                exponent--;
            } else {
                exact = 0;
            }
            p++;
        }
    }
    if (p < end && (*p == 'e' || *p == 'E')) {
        p++;
        int exponent_negative = 0;
        int64_t written = 0;
        if (p < end && (*p == '+' || *p == '-')) {
            exponent_negative = *p == '-';
            p++;
        }
        if (p >= end || *p < '0' || *p > '9') return 0;
        while (p < end && *p >= '0' && *p <= '9') {
            if (written < 100000) written = written * 10 + (*p - '0');
            p++;
        }
        exponent += exponent_negative ? -written : written;
    }
    double value;
    if (exact && exponent >= -22 && exponent <= 22) {
        value = (double)mantissa; /* exact: at most 2^53 */
        value = exponent >= 0 ? value * POWERS_OF_TEN[exponent] : value / POWERS_OF_TEN[-exponent];
        if (negative) value = -value;
    } else {
        size_t length = (size_t)(p - start);
        if (length >= MAX_NUMBER_CHARS) return 0;
        char text[MAX_NUMBER_CHARS];
        memcpy(text, start, length);
        text[length] = '\0';
        value = strtod(text, NULL);
    }
    if (value > FLT_MAX || value < -FLT_MAX) return 0; /* inf included */
    *out = (float)value;
    c->at = p;
    return 1;
}

/* The index of the input named by the key [start, start + length), or -1. Clients send an instance's keys in
 * one order, so the search starts after the last key found and wraps around. */
static int32_t find_name(const uint8_t *start, int64_t length, const uint8_t *names, const int32_t *offsets,
                         int32_t count, int32_t after) {
    for (int32_t step = 1; step <= count; step++) {
        int32_t index = (after + step) % count;
        int32_t name_length = offsets[index + 1] - offsets[index];
        if (name_length == length && memcmp(names + offsets[index], start, (size_t)length) == 0) {
            return index;
        }
    }
    return -1;
}

/* Reads one instance object into row `row`; the cursor on its '{'. `seen` (one stamp per input) finds a key
 * given twice. */
static int read_instance(cursor *c, int64_t row, const uint8_t *names, const int32_t *offsets, int32_t count,
                         const int32_t *kinds, const int32_t *columns, int32_t num_floats, int32_t num_strings,
                         float *floats, int64_t *spans, int64_t *stamps, int64_t *longest,
                         const uint8_t *base, text_buffer *text) {
    float *float_row = floats + row * num_floats;
    int64_t *span_row = spans + row * num_strings * 2;
    for (int32_t i = 0; i < num_floats; i++) float_row[i] = __builtin_nanf("");
    for (int32_t i = 0; i < num_strings * 2; i++) span_row[i] = 0;
    if (!take(c, '{')) return 0;
    if (take(c, '}')) return 1;
    int32_t last = count - 1;
    for (;;) {
        skip_space(c);
        const uint8_t *key;
        int64_t key_length;
        if (!read_string(c, &key, &key_length)) return 0;
        int32_t index = find_name(key, key_length, names, offsets, count, last);
        if (index < 0 || stamps[index] == row + 1) return 0;
        stamps[index] = row + 1;
        last = index;
        if (!take(c, ':')) return 0;
        skip_space(c);
        if (take_word(c, "null", 4)) {
            /* NaN or the empty string, as set above */
        } else if (kinds[index] == 0) {
            if (!read_number(c, &float_row[columns[index]])) return 0;
        } else {
            const uint8_t *value;
            int64_t value_offset, value_length;
            if (read_string(c, &value, &value_length)) {
                value_offset = value - base;
            } else if (!read_escaped(c, text, &value_offset, &value_length)) {
                return 0;
            }
            span_row[columns[index] * 2] = value_offset;
            span_row[columns[index] * 2 + 1] = value_length;
            if (value_length > *longest) *longest = value_length;
        }
        if (take(c, ',')) continue;
        return take(c, '}');
    }
}

/* Reads the body. Returns the number of instances, CTR_ROWS_TOO_MANY when there are more than `max_rows`, or
 * CTR_ROWS_NOT_HANDLED. `names` holds the inputs' names back to back, `offsets` [count + 1] where each starts;
 * `kinds` [count]: 0 a float column, 1 a string column; `columns` [count]: its column among those of its kind.
 * `stamps` [count]: scratch, zeroed by the caller. `longest`: the longest string read. `text` [length]: where
 * strings with escapes are written decoded (never longer than the body); their spans' offsets start at
 * `length`. */
int64_t ctr_read_instances(const uint8_t *body, int64_t length, const uint8_t *names, const int32_t *offsets,
                           int32_t count, const int32_t *kinds, const int32_t *columns, int32_t num_floats,
                           int32_t num_strings, const uint8_t *signature, int32_t signature_length,
                           int64_t max_rows, float *floats, int64_t *spans, int64_t *stamps, int64_t *longest,
                           uint8_t *text_data) {
    cursor c = {body, body + length};
    text_buffer text = {text_data, 0, length, length};
    int have_instances = 0, have_signature = 0;
    int64_t rows = 0;
    *longest = 0;
    if (count <= 0 || !take(&c, '{')) return CTR_ROWS_NOT_HANDLED;
    if (take(&c, '}')) return CTR_ROWS_NOT_HANDLED;
    for (;;) {
        skip_space(&c);
        const uint8_t *key;
        int64_t key_length;
        if (!read_string(&c, &key, &key_length) || !take(&c, ':')) return CTR_ROWS_NOT_HANDLED;
        skip_space(&c);
        if (key_length == 9 && memcmp(key, "instances", 9) == 0 && !have_instances) {
            have_instances = 1;
            if (!take(&c, '[')) return CTR_ROWS_NOT_HANDLED;
            if (!take(&c, ']')) {
                for (;;) {
                    if (rows >= max_rows) return CTR_ROWS_TOO_MANY;
                    if (!read_instance(&c, rows, names, offsets, count, kinds, columns, num_floats, num_strings,
                                       floats, spans, stamps, longest, body, &text)) {
                        return CTR_ROWS_NOT_HANDLED;
                    }
                    rows++;
                    if (take(&c, ',')) continue;
                    if (take(&c, ']')) break;
                    return CTR_ROWS_NOT_HANDLED;
                }
            }
        } else if (key_length == 14 && memcmp(key, "signature_name", 14) == 0 && !have_signature) {
            have_signature = 1;
            const uint8_t *value;
            int64_t value_length;
            if (!read_string(&c, &value, &value_length) || value_length != signature_length ||
                memcmp(value, signature, (size_t)signature_length) != 0) {
                return CTR_ROWS_NOT_HANDLED;
            }
        } else {
            return CTR_ROWS_NOT_HANDLED;
        }
        if (take(&c, ',')) continue;
        if (!take(&c, '}')) return CTR_ROWS_NOT_HANDLED;
        break;
    }
    skip_space(&c);
    if (c.at != c.end || !have_instances) return CTR_ROWS_NOT_HANDLED;
    return rows;
}

/* The strings' spans copied into fixed-width cells of `width` bytes ([count] cells, zeroed by the caller):
 * numpy's "S<width>" layout, which TensorFlow reads as a string tensor (a cell's trailing zero bytes dropped:
 * a string read above holds none). A span's offset from `length` on is in `text`. */
void ctr_fill_cells(const uint8_t *body, int64_t length, const uint8_t *text, const int64_t *spans, int64_t count,
                    int64_t width, uint8_t *cells) {
    for (int64_t i = 0; i < count; i++) {
        int64_t offset = spans[i * 2], size = spans[i * 2 + 1];
        if (size > 0) {
            const uint8_t *from = offset < length ? body + offset : text + (offset - length);
            memcpy(cells + i * width, from, (size_t)size);
        }
    }
}
