"""sampling: later draws of a round

Round.draws_json (`gym-server serve --sample-rate q < 1`): the times a round that could not fill added another
independent draw of contributors. Null = the one draw at the round's opening, so existing rows need nothing.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-26 23:29:04.705319

"""
from typing import Sequence, Union

from alembic import op
import sqlalchemy as sa


# revision identifiers, used by Alembic.
revision: str = '0004'
down_revision: Union[str, Sequence[str], None] = '0003'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    """Upgrade schema."""
    with op.batch_alter_table('round', schema=None) as batch_op:
        batch_op.add_column(sa.Column('draws_json', sa.String(), nullable=True))


def downgrade() -> None:
    """Downgrade schema."""
    with op.batch_alter_table('round', schema=None) as batch_op:
        batch_op.drop_column('draws_json')
