/* A row-form predict body read straight into the packed endpoint's buffers, in one pass over its bytes.
 *
 * The body is TF Serving's row form: {"instances": [{"<input>": <value>, ...}, ...], "signature_name": "..."}.
 * Every input is a float column (a JSON number or null) or a string column (a JSON string or null). Numbers go
 * into a float32 matrix [rows, floats] (null or a missing key: NaN); strings are left where they are in the body
 * and their spans (offset, length) written to [rows, strings, 2] (null or a missing key: length 0).
 *
 * It reads only what it can read exactly as the general path (msgspec, then the column converters) reads it,
 * and answers CTR_ROWS_NOT_HANDLED for anything else: a string with an escape, bytes that are not UTF-8, a
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

/* A JSON string with no escapes, of well-formed UTF-8 and no control characters; the cursor on its opening
 * quote. Sets its content's span; 0 for anything else (an escape included: the general path decodes those). */
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
        /* UTF-8: no overlong forms, no surrogates, nothing above U+10FFFF. */
        if (b >= 0xC2 && b <= 0xDF) {
            if (end - p < 2 || (p[1] & 0xC0) != 0x80) return 0;
            p += 2;
        } else if (b >= 0xE0 && b <= 0xEF) {
            if (end - p < 3 || (p[1] & 0xC0) != 0x80 || (p[2] & 0xC0) != 0x80) return 0;
            if (b == 0xE0 && p[1] < 0xA0) return 0;
            if (b == 0xED && p[1] > 0x9F) return 0;
            p += 3;
        } else if (b >= 0xF0 && b <= 0xF4) {
            if (end - p < 4 || (p[1] & 0xC0) != 0x80 || (p[2] & 0xC0) != 0x80 || (p[3] & 0xC0) != 0x80) return 0;
            if (b == 0xF0 && p[1] < 0x90) return 0;
            if (b == 0xF4 && p[1] > 0x8F) return 0;
            p += 4;
        } else {
            return 0;
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
                         const uint8_t *base) {
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
            int64_t value_length;
            if (!read_string(c, &value, &value_length)) return 0;
            span_row[columns[index] * 2] = value - base;
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
 * `stamps` [count]: scratch, zeroed by the caller. `longest`: the longest string read. */
int64_t ctr_read_instances(const uint8_t *body, int64_t length, const uint8_t *names, const int32_t *offsets,
                           int32_t count, const int32_t *kinds, const int32_t *columns, int32_t num_floats,
                           int32_t num_strings, const uint8_t *signature, int32_t signature_length,
                           int64_t max_rows, float *floats, int64_t *spans, int64_t *stamps, int64_t *longest) {
    cursor c = {body, body + length};
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
                                       floats, spans, stamps, longest, body)) {
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
 * a string read above holds none). */
void ctr_fill_cells(const uint8_t *body, const int64_t *spans, int64_t count, int64_t width, uint8_t *cells) {
    for (int64_t i = 0; i < count; i++) {
        int64_t length = spans[i * 2 + 1];
        if (length > 0) memcpy(cells + i * width, body + spans[i * 2], (size_t)length);
    }
}
